"""A build says what it will run and, once, an estimate of its time measured on the first unit of work it
really does (issue 44, deliverable 2): ``lukv build`` on a 0.5B model on a CPU runs for tens of minutes."""

from types import SimpleNamespace

import torch

from lukv_cache import build_profile
from lukv_cache.cli import main
from lukv_cache.profiling import build as build_module
from lukv_cache.profiling import cli as profiling_cli
from lukv_cache.profiling import eta
from lukv_cache.profiling.kvzap_options import KVzapTraining

ESTIMATE = "an estimate, measured on the first"


def _lukv_build(tiny_model, byte_tokenizer, calibration, cache_dir, monkeypatch, *extra):
    monkeypatch.setattr(
        profiling_cli, "_load_model", lambda name: (tiny_model, byte_tokenizer, {"weights": "random"})
    )
    args = ["build", "tiny", "--k-max", "2", "--calibration", str(calibration), "--model-id", "org/tiny"]
    return main([*args, "--cache-dir", str(cache_dir), "--out", str(cache_dir / "p.safetensors"), *extra])


def test_lukv_build_says_its_questions_then_an_estimate_measured_on_the_first(
    tiny_model, byte_tokenizer, tiny_calibration, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(build_module, "ORACLE_BATCH_BYTES", 1)  # one question a batch: something to estimate
    assert _lukv_build(tiny_model, byte_tokenizer, tiny_calibration, tmp_path, monkeypatch) == 0
    err = capsys.readouterr().err
    assert "LU-KV profile: 3 questions, each decoding up to 2 answer tokens after the" in err
    assert "decoded together in batches of up to 1;" in err and "0 kept from an earlier build" in err
    said = [line for line in err.splitlines() if ESTIMATE in line and "LU-KV profile" in line]
    assert len(said) == 1, err  # once
    assert "the first batch took" in said[0] and "for the 2 questions left" in said[0]
    # the memory table says its windows and runs, then an estimate from its first window, once
    # (in bfloat16 over a float32 prefill where the CPU multiplies bfloat16 natively: --table-dtype auto)
    assert "memory table: 4 windows of " in err and "19 runs each (3 precisions x 6 ratios) in " in err
    assert "one backward pass on 4 windows for the layers' losses in " in err
    table = [line for line in err.splitlines() if ESTIMATE in line and "memory table" in line]
    assert len(table) == 1 and "the first window took" in table[0] and "for the 3 windows left" in table[0]
    layers = [line for line in err.splitlines() if ESTIMATE in line and "layers' losses" in line]
    assert len(layers) == 1 and "for the 3 windows left" in layers[0]


def test_questions_that_fit_one_batch_are_decoded_at_once_with_nothing_to_estimate(
    tiny_model, byte_tokenizer, tiny_calibration, tmp_path, monkeypatch, capsys
):
    assert _lukv_build(tiny_model, byte_tokenizer, tiny_calibration, tmp_path, monkeypatch) == 0
    err = capsys.readouterr().err
    assert "decoded together in batches of up to 3;" in err
    assert not [line for line in err.splitlines() if ESTIMATE in line and "LU-KV profile" in line]


def test_a_resumed_build_says_what_it_kept_and_estimates_nothing(
    tiny_model, byte_tokenizer, tiny_calibration, tmp_path, monkeypatch, capsys
):
    assert _lukv_build(tiny_model, byte_tokenizer, tiny_calibration, tmp_path, monkeypatch, "--quiet") == 0
    assert _lukv_build(tiny_model, byte_tokenizer, tiny_calibration, tmp_path, monkeypatch) == 0
    err = capsys.readouterr().err
    assert "3 kept from an earlier build" in err
    assert not [line for line in err.splitlines() if ESTIMATE in line and "LU-KV profile" in line]


def test_quiet_says_no_estimate(tiny_model, byte_tokenizer, tiny_calibration, tmp_path, monkeypatch, capsys):
    assert _lukv_build(tiny_model, byte_tokenizer, tiny_calibration, tmp_path, monkeypatch, "--quiet") == 0
    err = capsys.readouterr().err
    assert "LU-KV profile" not in err and ESTIMATE not in err


def test_a_kvzap_build_says_its_documents_and_tokens_then_an_estimate(
    tiny_model, byte_tokenizer, tiny_calibration, tmp_path, capsys
):
    tiny_model.config.name_or_path = "org/tiny"
    training = KVzapTraining(documents=((2, 64), (1, 96)), corpora=("news",), family="linear")
    build_profile(
        tiny_model, byte_tokenizer, "kvzap", tiny_calibration, k_max=2, cache_dir=tmp_path, kvzap=training
    )
    err = capsys.readouterr().err
    assert "KVzap surrogate: 3 documents, 224 tokens;" in err
    said = [line for line in err.splitlines() if "KVzap surrogate: the first document" in line]
    assert len(said) == 1 and "for the 2 documents left (160 tokens)" in said[0] and ESTIMATE in said[0], err


def test_the_document_estimate_skips_kept_documents_and_scales_by_tokens(monkeypatch):
    clock_time = [100.0]
    monkeypatch.setattr(eta, "time", SimpleNamespace(perf_counter=lambda: clock_time[0]))
    lines: list[str] = []
    docs = [torch.zeros(1, n, dtype=torch.long) for n in (64, 64, 128, 256)]
    clock = eta.DocumentClock(lines.append, docs, kept=[True, False, False, True])
    assert "4 documents, 512 tokens" in lines[0] and "on the 2 whose targets" in lines[0]
    clock_time[0] += 1  # the kept document: read back, not measured
    clock.done(1)
    clock_time[0] += 2  # the first repeat pass: 2 s for 64 tokens
    clock.done(2)
    clock_time[0] += 4
    clock.done(3)
    assert len(lines) == 2  # said once
    assert (
        "the first document (64 tokens) took 2 s; about 4 s for the 1 document left (128 tokens)" in lines[1]
    )
