"""search_env: a Search-R1-style local-corpus search environment for Libra (an example outside the package).

- :mod:`search_env.corpus`: the made-up corpus and question sets, generated from one seed (shipped in ``data/``).
- :mod:`search_env.retriever`: BM25 over the corpus (``bm25s``).
- :mod:`search_env.tools`: the ``search`` tool, declared with Libra's tool contract.
- :mod:`search_env.env`: the environment (``[env] entry = "search_env.env:SearchEnv"``).
- :mod:`search_env.agent`: the same task as agent code written with the ``openai`` client.
"""
