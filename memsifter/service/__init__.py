"""Memory retrieval as a service (issue 32): ``memsifter serve``.

- :mod:`.config`: the pydantic config (no secrets: env var names only);
- :mod:`.index`: an embed stage's publication loaded as per-corpus indexes, scored with the stage's code;
- :mod:`.memory`: user memories appended over HTTP, persisted as atomic segments;
- :mod:`.core`: the routes' logic, reloads, batching; :mod:`.http`: the FastAPI app;
- :mod:`.ranker`: the rank stage's prompt builder and parser behind ``mode: ranked``;
- :mod:`.app`: the Ray Serve deployments (``memsifter.service.app:build_app``); :mod:`.cli`: the command.
"""
