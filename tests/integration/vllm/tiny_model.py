"""A tiny random-weight Llama and a word-level tokenizer, built locally for vLLM tests.

No model hub is reachable, so the real-engine tests make their own model: 2 layers,
hidden size 64, head dim 32 (a size the CPU attention backend supports), 512 tokens,
fp32 safetensors, about 150k parameters. Weights come from a fixed seed, so two builds
are identical; a build is skipped when the directory already holds one with the same
spec. Import this only inside the vLLM environment (it needs torch and transformers).

    python -m tests.integration.vllm.tiny_model DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SEED = 0
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")  # ids 0..3: unk, bos, eos, pad
WORDS = (  # split in _vocab()
    "the a an and or but if then of to in on at by for with from is are was were be "
    "it this that these those i you he she we they me him her us them my your hello "
    "world quick brown fox jumps over lazy dog cat request token engine worker drain "
    "model server queue stop wait done ready busy idle yes no one two three four five "
    ". , ! ?"
)
CONFIG: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 2048,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 3,
    "tie_word_embeddings": False,
}
MAX_MODEL_LEN = 512
ENGINE_DTYPE = "float32"
"""The dtype every test and benchmark engine runs in. vLLM's CPU default is bfloat16, and
with bfloat16 on a CPU that reports AMX, vLLM 0.32's CPU attention picks its AMX kernel,
which killed the model worker with SIGILL (exit -4) on this kind of machine (a VM whose
CPU flags list AMX). float32 selects the AVX-512 kernel."""
GPU_SHARE_ENV = "QUIESCE_GPU_MEMORY_UTILIZATION"
"""Set by the GPU suite: the share of the GPU each engine may take (several run at once)."""


def engine_kwargs() -> dict[str, Any]:
    """The engine arguments every test and benchmark engine shares."""
    kwargs: dict[str, Any] = {"max_model_len": MAX_MODEL_LEN, "enforce_eager": True,
                              "dtype": ENGINE_DTYPE}
    share = os.environ.get(GPU_SHARE_ENV)
    if share:
        kwargs["gpu_memory_utilization"] = float(share)
    return kwargs


def holding_connector(release_dir: Path) -> Any:
    """The ``kv_transfer_config`` of an engine whose finished requests hold their KV until
    ``release_dir/release`` exists (:mod:`tests.integration.vllm.holding_connector`)."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="HoldingConnector",
        kv_connector_module_path="tests.integration.vllm.holding_connector",
        kv_role="kv_producer", kv_connector_extra_config={"release_dir": str(release_dir)})


SPEC_FILE = "quiesce_tiny_model.json"
# Bump when the build changes in a way the config does not show.
SPEC: dict[str, Any] = {"format": 1, "seed": SEED, "dtype": "float32", "config": CONFIG}


def _vocab() -> dict[str, int]:
    """Special tokens, the words above, then filler words up to the model's vocab size."""
    tokens = list(SPECIAL_TOKENS) + list(dict.fromkeys(WORDS.split()))
    tokens += [f"w{i}" for i in range(CONFIG["vocab_size"] - len(tokens))]
    return {token: i for i, token in enumerate(tokens)}


def _is_built(directory: Path) -> bool:
    try:
        spec = json.loads((directory / SPEC_FILE).read_text())
    except (OSError, ValueError):
        return False
    required = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    return bool(spec == SPEC) and all((directory / name).is_file() for name in required)


def build_tiny_llama(directory: Path) -> Path:
    """Write the tiny model and its tokenizer into `directory` (created) and return it.

    Deterministic and idempotent: a directory already holding this spec is left as is.
    """
    directory = Path(directory)
    if _is_built(directory):
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    (directory / SPEC_FILE).unlink(missing_ok=True)

    torch.manual_seed(SEED)
    config = LlamaConfig(**CONFIG, dtype="float32")
    model = LlamaForCausalLM(config)  # fp32: torch's default dtype
    model.save_pretrained(directory)

    tokenizer = Tokenizer(WordLevel(vocab=_vocab(), unk_token="<unk>"))
    tokenizer.pre_tokenizer = Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=CONFIG["max_position_embeddings"],
    )
    fast.save_pretrained(directory)

    # Written last: its presence marks a complete build.
    (directory / SPEC_FILE).write_text(json.dumps(SPEC, indent=2, sort_keys=True) + "\n")
    return directory


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.integration.vllm.tiny_model DIR", file=sys.stderr)
        return 2
    print(build_tiny_llama(Path(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
