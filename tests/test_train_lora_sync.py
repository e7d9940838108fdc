"""The LoRA weight sync of the train stage, checked on CPU with verl 0.9.1's own functions.

On the H100 (benchmarks/gpu/results/2026-11-24-h100-m2) DAPO with LoRA stopped at the first sync: vLLM
0.24 raised StopIteration in ``_create_merged_loras_inplace`` because verl sent it an adapter with no
tensor. Cause, reproduced here: under FSDP1, peft (>= 0.21) derives the adapter's key prefixes from
module names that keep FSDP's inner ``_fsdp_wrapped_module.``, so ``get_peft_model_state_dict`` matches
no key and ``collect_lora_params`` returns nothing, for a fresh LoRA and a pretrained adapter alike.
The train stage therefore sets ``actor_rollout_ref.model.lora.merge=True``: each sync sends the
adapter merged into whole weights. One rank, gloo, a 2-layer random Llama (the model is not the point).
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("verl")

import torch.distributed as dist  # noqa: E402
from peft import LoraConfig, PeftModel, TaskType, get_peft_model  # noqa: E402
from torch.distributed.fsdp import FullStateDictConfig, ShardingStrategy, StateDictType  # noqa: E402
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from memsifter.testing.servers import free_port  # noqa: E402

CFG = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True)
LORA = dict(task_type=TaskType.CAUSAL_LM, r=16, lora_alpha=32, target_modules="all-linear", bias="none")


def base() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(CFG)


@pytest.fixture(scope="module")
def group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    """A saved PEFT adapter (as the sft stage writes it) with non-zero lora_B, so merging changes weights."""
    d = tmp_path_factory.mktemp("adapter")
    m = get_peft_model(base(), LoraConfig(**LORA))
    for n, p in m.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p.data, std=0.02)
    m.save_pretrained(str(d))
    return str(d)


def actor(kind: str, adapter: str):
    """The actor as verl builds it (transformer_impl): a fresh LoRA or ``lora_adapter_path``, FSDP1."""
    from verl.utils.fsdp_utils import get_fsdp_wrap_policy

    module = base()
    module.enable_input_require_grads()
    if kind == "fresh":
        module = get_peft_model(module, LoraConfig(**LORA))
    else:
        module = PeftModel.from_pretrained(module, adapter, is_trainable=True)
    f = FSDP(module, auto_wrap_policy=get_fsdp_wrap_policy(module, config={"min_num_params": 0}, is_lora=True),
             device_id=torch.device("cpu"), sharding_strategy=ShardingStrategy.FULL_SHARD,
             sync_module_states=False, use_orig_params=False)
    FSDP.set_state_dict_type(f, state_dict_type=StateDictType.FULL_STATE_DICT, state_dict_config=FullStateDictConfig())
    return f


@pytest.mark.parametrize("kind", ["fresh", "pretrained"])
def test_adapter_only_sync_is_empty_under_fsdp1(group, adapter_dir, kind):
    """The upstream bug the merged sync avoids. If a verl/peft upgrade fixes it, this fails: the cheaper
    adapter-only sync (vLLM with LoRA) can then come back in memsifter/stages/train.py."""
    from verl.utils.fsdp_utils import collect_lora_params

    sent = collect_lora_params(actor(kind, adapter_dir), layered_summon=False, base_sync_done=True)
    assert len(sent) == 0, f"verl now sends {len(sent)} LoRA tensors under FSDP1: e.g. {list(sent)[:2]}"


def test_merged_sync_sends_the_adapters_merged_weights(group, adapter_dir):
    """What ``model.lora.merge=True`` makes verl send: every weight under its HF name, equal to
    merge_and_unload() of the adapter; afterwards the actor holds the unmerged base again."""
    from verl.utils.fsdp_utils import merged_lora_context, normalize_peft_param_name
    from verl.utils.model import convert_weight_keys

    f = actor("pretrained", adapter_dir)
    with merged_lora_context(f, backup_adapters=True):
        sent = convert_weight_keys(normalize_peft_param_name(f.state_dict()), f._fsdp_wrapped_module)
        sent = {k: v.detach().clone() for k, v in sent.items()}
    want = PeftModel.from_pretrained(base(), adapter_dir).merge_and_unload().state_dict()
    assert sorted(sent) == sorted(want)
    assert max((sent[k].float() - want[k].float()).abs().max().item() for k in want) < 1e-6
    # the adapter changed the weights (the check is not vacuous) ...
    plain = base().state_dict()
    k = "model.layers.0.self_attn.q_proj.weight"
    assert (sent[k] - plain[k]).abs().max().item() > 1e-4
    # ... and the actor is unmerged again after the sync (the adapter keeps training)
    with FSDP.summon_full_params(f):
        after = normalize_peft_param_name(f._fsdp_wrapped_module.state_dict())
    assert max((after[n] - plain[n]).abs().max().item() for n in plain if n in after) == 0.0
