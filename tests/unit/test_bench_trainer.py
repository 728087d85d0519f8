"""``python -m libra.bench trainer``: its arguments are checked before anything starts (the run itself is a
benchmark: FSDP and DDP ranks spawned in the same run, ``libra/bench/trainer.py``)."""

from __future__ import annotations

import pytest

from libra.bench.trainer import main


@pytest.mark.parametrize("argv, message", [
    (["--shape", "qwen2-72b"], "unknown --shape"),
    (["--steps", "0"], "must be >= 1"),
    (["--device", "cuda"], "no CUDA device"),
])
def test_bad_arguments_are_refused_with_their_reason(argv, message, capsys) -> None:
    import torch

    if argv[:2] == ["--device", "cuda"] and torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
