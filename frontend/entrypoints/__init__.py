"""The applications built on tidal's client library (vLLM's `entrypoints`): the `tidal` CLI
(`cli.py`), the OpenAI-compatible server (`openai/`) and the offline checkpoint maker
(`make_model.py`). They import the library by its public names only (`tidal.frontend`,
`tidal.protocol`), so the library can change inside without them."""
