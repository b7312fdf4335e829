"""``lukv check`` refuses what it cannot measure before the model's weights load: contexts longer than the
model's positions (without tokenising megabytes), no decoded tokens, bad settings, non-UTF-8 files."""

from __future__ import annotations

import pytest
from demo_helpers import byte_tokenizer, tiny_llama

from lukv_cache.cli import main
from lukv_cache.errors import ConfigurationError, UnknownNameError
from lukv_cache.evaluation.check.run import check
from lukv_cache.testing import flat_profile

POSITIONS = 2048  # tiny_llama's max_position_embeddings


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama and its byte tokenizer saved as a model folder, as a user would pass one."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama().save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


def _files(tmp_path, text: str | bytes = "The ferry leaves at nine. ", questions: str | bytes = "When?\n"):
    paths = []
    for name, content in (("context.txt", text), ("q.txt", questions)):
        path = tmp_path / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        paths.append(str(path))
    return paths


def _check(model_dir, tmp_path, *extra, text="The ferry leaves at nine. ", questions="When?\n"):
    context, qs = _files(tmp_path, text, questions)
    return main(["check", str(model_dir), "--text", context, "--questions", qs, "--quiet", *extra])


def test_a_context_longer_than_the_models_positions_is_refused_before_the_weights_load(
    model_dir, tmp_path, no_weights, capsys
):
    assert _check(model_dir, tmp_path, text="x" * (POSITIONS + 10)) == 2
    err = capsys.readouterr().err
    assert "positions" in err and f"the model has {POSITIONS}" in err and "shorter" in err


def test_a_megabytes_long_context_is_refused_without_being_tokenised():
    from lukv_cache.evaluation.check.inputs import encode_contexts

    tokenizer = byte_tokenizer()
    seen = []

    class Spy:
        def get_vocab(self):
            return tokenizer.get_vocab()

        def __call__(self, text, **kwargs):
            seen.append(len(text))
            return tokenizer(text, **kwargs)

    config = tiny_llama().config
    with pytest.raises(ConfigurationError, match="characters.*positions but the model has 2048"):
        encode_contexts(Spy(), [("word " * 2_000_000, ["When?"])], config, 24)
    assert seen == []


def test_check_refuses_a_context_that_does_not_fit_before_any_prefill(model, tokenizer):
    context = "abc" * 700  # 2,100 byte tokens: more than the 2,048 positions
    with pytest.raises(ConfigurationError, match="2,100 tokens.*positions but the model has 2048"):
        check(model, tokenizer, [(context, ["Why?"])], ratios=(0.5,), allocators=("uniform",),
              max_new_tokens=4, show_progress=False)  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-new-tokens", "0"], "max_new_tokens must be at least 1"),
        (["--max-new-tokens", "-3"], "max_new_tokens must be at least 1"),
        (["--tolerance", "1.5"], "tolerance"),
        (["--tolerance", "0"], "tolerance"),
        (["--scorer", "h2o"], "h2o"),
        (["--allocators", "uniform", "nope"], "nope"),
        (["--ratios", "0.5", "1.5"], "ratio is the fraction"),
        (["--ratios", "-0.1"], "ratio is the fraction"),
    ],
)
def test_bad_settings_are_refused_before_the_weights_load(
    model_dir, tmp_path, no_weights, capsys, args, message
):
    assert _check(model_dir, tmp_path, *args) == 2
    assert message in capsys.readouterr().err


def test_check_refuses_no_decoded_tokens_and_unknown_allocators(model, tokenizer):
    contexts = [("The ferry leaves at nine.", ["When?"])]
    with pytest.raises(ConfigurationError, match="max_new_tokens"):
        check(model, tokenizer, contexts, max_new_tokens=0, show_progress=False)
    with pytest.raises(UnknownNameError, match="nope"):
        check(model, tokenizer, contexts, allocators=("nope",), max_new_tokens=2, show_progress=False)


@pytest.mark.parametrize("which", ["text", "questions"])
def test_a_non_utf8_file_is_a_typed_error_naming_it(model_dir, tmp_path, no_weights, capsys, which):
    latin1 = "Caf\xe9 at nine.\n".encode("latin-1")
    kwargs = {"text": latin1} if which == "text" else {"questions": latin1}
    assert _check(model_dir, tmp_path, **kwargs) == 2
    err = capsys.readouterr().err
    name = "context.txt" if which == "text" else "q.txt"
    assert err.startswith("error: ") and name in err and "UTF-8" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "command",
    [
        ["check", "smollm2", "--text", "t.txt", "--questions", "q.txt"],
        ["demo"],
        ["bench"],
        ["build", "smollm2", "--out", "o/"],
    ],
)
@pytest.mark.parametrize("threads", ["-2", "0", "two"])
def test_a_bad_thread_count_is_an_argparse_error(command, threads, capsys):
    with pytest.raises(SystemExit) as info:
        main([*command, "--threads", threads])
    assert info.value.code == 2
    assert "argument --threads: must be a positive number of CPU threads" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["", "   \n\t\n"])
def test_an_empty_context_is_refused_before_the_weights_load(model_dir, tmp_path, no_weights, capsys, text):
    assert _check(model_dir, tmp_path, text=text) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    assert "context.txt" in err and "empty" in err


def test_check_refuses_an_empty_context_before_any_prefill(model, tokenizer):
    with pytest.raises(ConfigurationError, match="empty"):
        check(model, tokenizer, [("", ["When?"])], ratios=[0.5], allocators=["uniform"], show_progress=False)


def _folder_profile(model_dir, scorer, out_dir, surrogate=None):
    """A profile built for the model folder (model_id = the folder, as `lukv build <folder>` writes it)."""
    profile = flat_profile(
        2,
        2,
        grid=[0.25, 0.5, 0.75, 0.95],
        model_id=str(model_dir),
        scorer=scorer,
        head_dim=16,
        window=1,
        surrogate=surrogate,
    )
    return profile.save(out_dir / f"{scorer}.safetensors")


def _kvzap_surrogate():
    from lukv_cache.testing import random_surrogate

    surrogate = random_surrogate(2, 2, 16, bias=False)
    surrogate.meta["thresholds"] = {"grid": [0.25, 0.5, 0.75], "values": [-1.0, 0.0, 1.0]}
    return surrogate


def _rows(out: str) -> dict[str, str]:
    """allocator -> its first table line ('skipped: ...' or the figures)."""
    rows = {}
    for line in out.splitlines():
        parts = line.split(maxsplit=2)
        if len(parts) == 3 and parts[1].replace(".", "").isdigit():
            rows.setdefault(parts[0], parts[2])
    return rows


def test_docs_check_example_on_a_model_folder_skips_a_missing_profile_with_a_note(
    model_dir, tmp_path, capsys
):
    """docs/check.md: `lukv check ./my-model --text ... --questions ... --scorer keydiff` (the default
    allocators include profile): the profile rows are skipped with a note, the others measured."""
    assert _check(model_dir, tmp_path, "--scorer", "keydiff", "--ratios", "0.5") == 0, capsys.readouterr().err
    rows = _rows(capsys.readouterr().out)
    assert (
        rows["profile"].startswith("skipped:")
        and "keydiff" in rows["profile"]
        and "--profiles" in rows["profile"]
    )
    assert not rows["uniform"].startswith("skipped") and not rows["adakv"].startswith("skipped")


def test_a_model_folder_reads_the_profiles_given(model_dir, tmp_path, capsys):
    profiles = tmp_path / "profiles"
    _folder_profile(model_dir, "keydiff", profiles)
    assert _check(model_dir, tmp_path, "--ratios", "0.5", "--profiles", str(profiles)) == 0
    rows = _rows(capsys.readouterr().out)
    assert not rows["profile"].startswith("skipped"), rows


@pytest.mark.parametrize("allocators", [["threshold"], ["uniform", "global"]])
def test_a_model_folder_reads_its_kvzap_profile_for_every_allocator(model_dir, tmp_path, capsys, allocators):
    profiles = tmp_path / "profiles"
    _folder_profile(model_dir, "kvzap", profiles, surrogate=_kvzap_surrogate())
    args = ["--scorer", "kvzap", "--ratios", "0.5", "--allocators", *allocators, "--profiles", str(profiles)]
    assert _check(model_dir, tmp_path, *args) == 0, capsys.readouterr().err
    rows = _rows(capsys.readouterr().out)
    assert all(not rows[a].startswith("skipped") for a in allocators), rows
    assert (
        _check(model_dir, tmp_path, "--scorer", "kvzap", "--ratios", "0.5", "--allocators", *allocators) == 0
    )
    rows = _rows(capsys.readouterr().out)
    assert all(rows[a].startswith("skipped") for a in allocators), rows


def test_a_model_folder_whose_config_names_a_hub_model_reads_that_models_profile(tmp_path, capsys):
    """A folder saved by an older transformers keeps `_name_or_path` in its config.json: the model it names
    is the profile's key (here a mirror of it in --profiles)."""
    import json

    from lukv_cache.profiles import save_to_local_dir

    folder = tmp_path / "fine-tune"
    tiny_llama().save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "_name_or_path": "org/tiny-base"}))
    from lukv_cache.profiles import Profile

    keydiff = Profile.load(_folder_profile(folder, "keydiff", tmp_path / "flat"))
    keydiff.model_id = "org/tiny-base"
    save_to_local_dir(keydiff, tmp_path / "mirror")
    assert _check(folder, tmp_path, "--ratios", "0.5", "--profiles", str(tmp_path / "mirror")) == 0
    rows = _rows(capsys.readouterr().out)
    assert not rows["profile"].startswith("skipped"), rows


def test_a_profile_of_another_shape_in_the_profiles_given_is_skipped_with_the_reason(
    model_dir, tmp_path, capsys
):
    flat_profile(5, 2, grid=[0.5], model_id="x").save(tmp_path / "p" / "keydiff.safetensors")
    assert _check(model_dir, tmp_path, "--ratios", "0.5", "--profiles", str(tmp_path / "p")) == 0
    rows = _rows(capsys.readouterr().out)
    assert rows["profile"].startswith("skipped:") and "5 layers" in rows["profile"], rows
