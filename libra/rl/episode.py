"""The episode session an environment's ``episode`` function drives: every turn through the broker.

An environment author writes::

    async def episode(s: EpisodeSession, task) -> float:
        text = await s.generate()                      # one model turn (a ``generate`` work item)
        out = await s.call_tool("python", {"code": c})  # one tool call (an ``action`` work item)
        s.add_user("Tool output: ...")                  # environment text (no loss on it)
        ...
        return reward

The session keeps the whole trajectory as token ids: the chat-templated prompt and every environment
message get loss mask 0; every generated token gets mask 1 and its rollout log-prob. Each ``generate``
sends the newest published weights (a data-plane ref: version + trainer endpoint) and records the weights
version the rollout actor actually used.

Bulk data stays off the broker: a turn carries only the tokens added since the previous turn, the total length
and digests (:class:`~libra.protocol.payloads_rollout.TurnContext`), never the whole growing context. The
rollout instance keeps the context between turns; the previous instance's reply names where it holds it
(``context_at``, sent back as ``holder``), and with a ``context_server`` (the episode runner's data-plane
server) the session also publishes its whole context as ``ctx/TRAJECTORY`` (the turn's ``source``), so an
instance that does not hold it (evicted, or the trajectory migrated) fetches it peer to peer; a first turn
whose prompt is longer than ``inline_tokens`` names it all as the prefix, so even the prompt stays off the
broker. Without a
``context_server``, an instance that can get the context nowhere fails the turn with ``context_missing`` and
the session sends that one turn in the whole form (``prompt_ids``); ``delta=False`` always does. Tokenisation happens here, in the
driver; the rollout actors see token ids only.

Each turn's args are a :class:`~libra.protocol.payloads_rollout.GenerateArgs` and its reply a
:class:`~libra.protocol.payloads_rollout.GenerateResult` (a malformed reply raises
:class:`~libra.protocol.payloads_base.PayloadError`); the sampling settings are
:class:`~libra.protocol.payloads_job.EpisodeSampling` (``SamplingParams`` here).

Messages after a model turn (``add_user``, ``add_message``, ``add_messages``) are rendered once by the
tokenizer's own chat template (:func:`template_continuation`: the text the template puts after an assistant
turn, then the new messages and the generation prompt; ChatML when the tokenizer has no template), tokenized
once and appended with loss mask 0. The ids the model sampled are never re-tokenized: the template's end-of-turn
token is the turn's own (the stop token it sampled; for a turn cut by ``max_new_tokens``, the session's first stop
token, as before), and the rest of the template's close follows it. ``set_prompt`` replaces the prompt before
the first turn (the OpenAI-compatible endpoint of :mod:`libra.serve` renders the agent's first message list).

Contracts: ``generate`` never runs after ``finish``; a turn's ``max_new_tokens`` is capped so the
sequence stays within ``max_total_tokens``; tool failures come back as a mapping with ``error`` set
(the episode decides what the model sees), never as an exception; ``set_prompt`` after a turn raises.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from libra.client import LibraError, ToolFailed
from libra.client.aio import AsyncClient
from libra.logging import get_logger
from libra.protocol.payloads_job import EpisodeSampling
from libra.protocol.payloads_refs import DataRef, WeightsRef
from libra.protocol.payloads_rollout import (
    EMPTY_DIGEST,
    ContextDigest,
    GenerateArgs,
    GenerateResult,
    TurnContext,
    ids_object,
)

__all__ = ["EpisodeSession", "SamplingParams", "chat_continuation", "template_continuation"]

GENERATE_BUCKET = "default"
log = get_logger("libra.rl.episode")


SamplingParams = EpisodeSampling  # an episode's sampling settings (the ``sampling`` entry of its args)


def chat_continuation(role: str, content: str) -> str:
    """ChatML text that closes the assistant turn just generated and opens the next one."""
    return f"\n<|im_start|>{role}\n{content}<|im_end|>\n<|im_start|>assistant\n"


_SENTINEL = "\u2063libra-turn-end\u2063"  # an assistant turn's content no template changes or meets elsewhere


def template_continuation(tokenizer: Any, messages: list[dict[str, Any]], tools: list[Any] | None = None) -> str:
    """The text the tokenizer's chat template puts after an assistant turn's content when ``messages``
    follow it: the turn's close (e.g. ``<|im_end|>\\n``), the messages, the generation prompt. Rendered once
    around a placeholder assistant turn, so a template's per-position rules (a default system prompt,
    ``tools=`` in the system message) stay before it. ChatML when the tokenizer has no chat template."""
    if not getattr(tokenizer, "chat_template", None):
        body = "".join(f"<|im_start|>{m['role']}\n{m.get('content') or ''}<|im_end|>\n" for m in messages)
        return f"<|im_end|>\n{body}<|im_start|>assistant\n"
    base = [{"role": "user", "content": "."}, {"role": "assistant", "content": _SENTINEL}]
    text = tokenizer.apply_chat_template(base + list(messages), tools=tools, add_generation_prompt=True,
                                         tokenize=False)
    if text.count(_SENTINEL) != 1:
        raise ValueError("the chat template does not render an assistant turn's content verbatim")
    return text.split(_SENTINEL, 1)[1]


@dataclass
class EpisodeSession:
    client: AsyncClient
    tokenizer: Any
    trajectory: str
    prompt_ids: list[int]
    params: SamplingParams
    weights: Callable[[], dict[str, Any] | None]  # newest published weights: a data-plane ref {"version", "endpoint", ...}
    stop_token_ids: list[int]
    seed: int | None = None
    prompt_id: str | None = None  # the same for every sample of a prompt: C-MLFQ's per-prompt tree key
    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    tool_calls: int = 0
    finished: bool = False
    gen_tokens: int = 0
    load_s: list[float] = field(default_factory=list)  # weights fetch+load seconds the rollout paid before each turn
    context_server: Any = None  # a DataPlaneServer the whole context is published on (re-prefill source)
    delta: bool = True  # send turns as deltas (TurnContext); False: the whole context every turn
    inline_tokens: int = 1024  # a first turn's prompt longer than this goes over the data plane too
    context_via: list[str | None] = field(default_factory=list)  # how the instance had each turn's context
    turn_bytes: list[int] = field(default_factory=list)  # each turn's args, msgpack bytes (what the broker carries)

    def __post_init__(self) -> None:
        self.input_ids = list(self.prompt_ids)
        self.loss_mask = [0] * len(self.prompt_ids)
        self.logprobs = [0.0] * len(self.prompt_ids)
        self._digest = ContextDigest(self.input_ids)  # of input_ids, extended as they grow
        self._known = (0, EMPTY_DIGEST)  # (length, digest) of the context the last turn's instance holds
        self._holder: DataRef | None = None  # where it holds it (GenerateResult.context_at)

    def set_prompt(self, prompt_ids: list[int]) -> None:
        """Replace the prompt (loss mask 0) before the first turn; after a turn it raises RuntimeError."""
        if self.versions or self.gen_tokens or any(self.loss_mask):
            raise RuntimeError("set_prompt after a turn was generated")
        self.prompt_ids = list(prompt_ids)
        self.__post_init__()

    def extend_context(self, ids: list[int]) -> None:
        """Append ids the model did not sample (environment text, already tokenized): loss mask 0."""
        self.input_ids += ids
        self._digest.update(ids)
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    async def generate(self, max_new_tokens: int | None = None) -> str:
        """One model turn from the whole sequence so far; returns the decoded text (stop token dropped).
        ``max_new_tokens`` may lower this turn's cap below the job's."""
        if self.finished:
            raise RuntimeError("generate after the episode finished")
        budget = self.params.max_total_tokens - len(self.input_ids)
        if budget < 1:
            return ""
        weights = self.weights()
        cap = self.params.max_new_tokens if max_new_tokens is None else max(1, min(max_new_tokens,
                                                                                  self.params.max_new_tokens))
        common = dict(
            prompt_tokens=len(self.input_ids),
            max_new_tokens=min(cap, budget),
            temperature=self.params.temperature, top_p=self.params.top_p,
            stop_token_ids=self.stop_token_ids,
            weights=WeightsRef.from_wire(weights) if weights is not None else None,
            seed=self.seed + len(self.versions) if self.seed is not None else None, prompt_id=self.prompt_id,
        )
        args = GenerateArgs(context=self._turn_context(), **common) if self.delta else \
            GenerateArgs(prompt_ids=self.input_ids, **common)
        try:
            out = await self._request(args)
        except ToolFailed as exc:
            if exc.tool_code != "context_missing" or not self.delta:
                raise
            log.info("context_resent_whole", trajectory=self.trajectory, tokens=len(self.input_ids))
            out = await self._request(GenerateArgs(prompt_ids=self.input_ids, **common))
        toks = out.token_ids
        self.input_ids += toks
        self._digest.update(toks)
        self._known = (len(self.input_ids), self._digest.hexdigest())
        self._holder = out.context_at
        self.context_via.append(out.context_via)
        self.loss_mask += [1] * len(toks)
        self.logprobs += out.logprobs
        self.versions.append(out.weights_version)
        self.load_s.append(out.load_s)
        self.gen_tokens += len(toks)
        shown = toks[:-1] if toks and toks[-1] in self.stop_token_ids else toks
        text = self.tokenizer.decode(shown, skip_special_tokens=True)
        self.texts.append(text)
        return text

    def _turn_context(self) -> TurnContext:
        known, known_digest = self._known
        source = None
        if self.context_server is not None:  # the whole context, for an instance that does not hold it
            header, chunks = ids_object(self.input_ids)
            ref = self.context_server.publish(f"ctx/{self.trajectory}", header, chunks)
            source = DataRef(endpoint=ref.endpoint, name=ref.name, server_key=ref.server_key)
            if known == 0 and len(self.input_ids) > self.inline_tokens:  # a long prompt: the instance fetches it
                known, known_digest = len(self.input_ids), self._digest.hexdigest()
        return TurnContext(new_ids=self.input_ids[known:], prefix_len=known, prefix_digest=known_digest,
                           total_len=len(self.input_ids), digest=self._digest.hexdigest(), source=source,
                           holder=self._holder)

    async def _request(self, args: GenerateArgs) -> GenerateResult:
        wire = args.to_wire()
        self.turn_bytes.append(len(msgspec.msgpack.encode(wire)))
        res = await self.client.request("generate", GENERATE_BUCKET, wire, self.trajectory,
                                        timeout=self.params.timeout_s)
        return GenerateResult.from_wire(res.output)

    def add_user(self, content: str) -> None:
        """Append an environment message (tool output, feedback) as a user turn; no loss on it."""
        self.add_messages([{"role": "user", "content": content}])

    def add_message(self, role: str, content: str | None, tool_calls: list[dict[str, Any]] | None = None,
                    **fields: Any) -> list[int]:
        """Append one message (``user``, ``tool``, ``system``...; ``fields`` such as ``tool_call_id`` or
        ``name`` go to the template); no loss on it. Returns the appended ids."""
        msg: dict[str, Any] = {"role": role, "content": content or "", **fields}
        if tool_calls:
            msg["tool_calls"] = tool_calls
        return self.add_messages([msg])

    def add_messages(self, messages: list[dict[str, Any]], tools: list[Any] | None = None) -> list[int]:
        """Append ``messages`` after the last turn through the chat template (:func:`template_continuation`),
        tokenized once, loss mask 0, ending on the generation prompt. Returns the appended ids."""
        ids = self.tokenizer.encode(template_continuation(self.tokenizer, messages, tools), add_special_tokens=False)
        if self.input_ids and self.loss_mask[-1] == 1:  # right after a model turn: the turn's own end token
            if ids and ids[0] in set(self.tokenizer.all_special_ids):
                ids = ids[1:]  # stands for the template's (its sampled stop token, kept as sampled) ...
            if self.input_ids[-1] not in self.stop_token_ids:
                ids = self.stop_token_ids[:1] + ids  # ... or, for a turn cut by max_new_tokens, the first stop token
        self.extend_context(ids)
        return ids

    async def call_tool(self, tool: str, args: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
        """Run ``tool`` through the broker; failures come back as ``{"error": "..."}``."""
        self.tool_calls += 1
        try:
            res = await self.client.call_tool(tool, args, trajectory=self.trajectory, timeout=timeout)
        except LibraError as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
        out = res.output
        return out if isinstance(out, dict) else {"output": out}

    async def finish(self, ok: bool = True) -> None:
        """Tell the broker's rollout router the trajectory ended (it learns output lengths)."""
        self.finished = True
        if self.context_server is not None:
            self.context_server.retire(f"ctx/{self.trajectory}")
        try:  # AsyncClient has no public end_trajectory yet: send the protocol message directly
            await self.client.end_trajectory(self.trajectory, self.gen_tokens, ok)
        except Exception as exc:  # noqa: BLE001  (advisory only: the router just learns less)
            log.info("end_trajectory_not_sent", trajectory=self.trajectory, error=repr(exc))
