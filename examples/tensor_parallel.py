"""Tensor parallelism: each rank's cache keeps its own block of KV heads, with single-process budgets.

    torchrun --nproc-per-node 3 examples/tensor_parallel.py           # SmolLM2-135M: 3 KV heads, one per rank
    torchrun --nproc-per-node 2 examples/tensor_parallel.py --smoke   # a tiny random model (2 KV heads)

transformers shards ``k_proj``/``v_proj`` over the ranks (``tp_plan="auto"``; gloo on CPU, NCCL on GPUs), so
rank r of N holds KV heads r*H/N ... (r+1)*H/N - 1. ``LUKVCache`` sees this from the sharded weights: nothing
else to pass. At each eviction the ranks all-gather their scores, all run the allocator on every head, and
keep their own block, so the budgets and the generated tokens are those of one process. The number of KV
heads must split evenly over the ranks. docs/tensor-parallel.md has the details.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, DistributedConfig

from lukv_cache import LUKVCache


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny random model and synthetic text")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # one CPU thread per rank

    if args.smoke:
        import _tiny

        _tiny.publish_profile()
        path, model_id = (
            _tiny.save(tempfile.mkdtemp(prefix=f"lukv-tp-rank{os.environ['RANK']}-")),
            _tiny.TINY_ID,
        )
        tokenizer, text = _tiny.tokenizer(), _tiny.text(800)
    else:
        from lukv_cache.models import SMOLLM2_MODEL_ID, load_tokenizer, smollm2_path
        from lukv_cache.texts import wikipedia_articles

        path, model_id = smollm2_path(), SMOLLM2_MODEL_ID  # the packaged model's safetensors folder
        tokenizer, text = load_tokenizer("smollm2"), wikipedia_articles()[0].text[:4000]

    # Every rank loads its shard; transformers starts the process group (torchrun's environment).
    model = AutoModelForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(tp_plan="auto"), attn_implementation="sdpa"
    ).eval()
    cache = LUKVCache.from_pretrained(model_id, ratio=0.8)  # the model's LU-KV profile, as in one process

    inputs = tokenizer(text + "\n\nIn one sentence, the text above is about", return_tensors="pt")
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=16, do_sample=False)

    rank, heads = dist.get_rank(), cache.head_shard.heads(model.config.num_key_value_heads)
    stored = cache.stored_tokens()  # [layers, batch, this rank's KV heads]
    print(
        f"rank {rank} of {dist.get_world_size()}: KV heads {heads.start}..{heads.stop - 1}, "
        f"{stored.float().mean():.0f} of {inputs['input_ids'].shape[1]} prompt tokens kept per head"
    )
    dist.barrier()
    if rank == 0:  # every rank generated the same tokens
        print(tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
