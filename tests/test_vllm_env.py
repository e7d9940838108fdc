"""The environment memsifter gives the vLLM engines it starts on the CPU (memsifter.models.vllm_env)."""

from __future__ import annotations

from memsifter.models.vllm_env import cpu_engine_env
from memsifter.models.vllm_server import VllmServerConfig, environment


def test_cpu_engines_get_passive_openmp_waits_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert cpu_engine_env()["OMP_WAIT_POLICY"] == "PASSIVE"
    cpu = VllmServerConfig(model="m", served_name="m")
    assert environment(cpu, base={})["OMP_WAIT_POLICY"] == "PASSIVE"
    # a value the user set is kept, in this process's environment or in the server's own settings
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert "OMP_WAIT_POLICY" not in cpu_engine_env()
    assert environment(cpu)["OMP_WAIT_POLICY"] == "ACTIVE"
    assert environment(cpu.model_copy(update={"env": {"OMP_WAIT_POLICY": "ACTIVE"}}), base={})["OMP_WAIT_POLICY"] \
        == "ACTIVE"
    # GPU engines are left as vLLM sets them
    gpu = VllmServerConfig(model="m", served_name="m", device="gpu")
    assert "OMP_WAIT_POLICY" not in environment(gpu, base={})
