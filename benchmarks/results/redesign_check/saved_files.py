"""Saved contexts across a refactor: `write` (run on the tree before) fills every case of
tests/cache/test_saved_contexts.py, saves it and records its kept tokens, bytes and file content;
`check` (run on the tree after) loads those files, compares kept tokens and bytes, saves them again and
compares the files' content (header and data; the save time pinned), and saves a fresh cache of each case
the same way to compare with the file the tree before wrote.

    PYTHONPATH=<tree> python saved_files.py write|check <tree> <folder>
"""

import hashlib
import json
import sys
import time
from pathlib import Path

mode, tree, folder = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
sys.path[:0] = [
    str(tree),
    str(tree / "tests"),
    str(tree / "tests" / "cache"),
    str(tree / "tests" / "attention"),
]
import torch  # noqa: E402

torch.set_num_threads(1)
time.gmtime = lambda *a: time.struct_time((2026, 12, 5, 0, 0, 0, 5, 339, 0))
import test_saved_contexts as tsc  # noqa: E402

from lukv_cache import load_cache, save_cache  # noqa: E402


def content(path):
    data = Path(path).read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    meta = header.get("__metadata__", {})
    return hashlib.sha256(json.dumps(header, sort_keys=True).encode() + data[8 + n :]).hexdigest(), len(meta)


def facts(cache):
    return {
        "stored": cache.stored_tokens().tolist(),
        "bytes": int(cache.memory_bytes()),
        "kept": [
            hashlib.sha256(cache.kept_positions(i).numpy().tobytes()).hexdigest()
            for i in range(len(cache.layers))
        ],
    }


folder.mkdir(parents=True, exist_ok=True)
report = {}
if mode == "write":
    for name in tsc.CASES:
        torch.manual_seed(0)
        model, cache, seq, mask = tsc._filled(name)
        path = save_cache(cache, folder / f"{name}.safetensors")
        report[name] = {"facts": facts(cache), "content": content(path)[0]}
    (folder / "before.json").write_text(json.dumps(report))
    print(f"wrote {len(report)} files")
else:
    before = json.loads((folder / "before.json").read_text())
    ok = True
    for name, want in before.items():
        torch.manual_seed(0)
        model, cache, seq, mask = tsc._filled(name)
        loaded = load_cache(folder / f"{name}.safetensors", model)
        same_facts = facts(loaded) == want["facts"]
        again = (
            content(save_cache(loaded, folder / f"{name}.again.safetensors", model=model))[0]
            == want["content"]
        )
        fresh = content(save_cache(cache, folder / f"{name}.fresh.safetensors"))[0] == want["content"]
        ok &= same_facts and again and fresh
        print(
            f"{name:40s} kept tokens and bytes equal: {same_facts}; saved again: same content {again}; "
            f"a fresh cache saved: same content {fresh}"
        )
    print("ALL EQUAL" if ok else "DIFFERENCES")
