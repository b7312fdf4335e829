"""The test Hub server speaks enough of the protocol for the unmodified huggingface_hub client."""

from __future__ import annotations

from huggingface_hub import HfApi, hf_hub_download


def test_upload_folder_readme_and_listing(hub, tmp_path, hf_cache):
    api = HfApi(endpoint=hub.url)
    api.create_repo("ns/repo")
    folder = tmp_path / "folder"
    (folder / "a" / "b").mkdir(parents=True)
    (folder / "a" / "b" / "x.txt").write_text("x")
    (folder / "README.md").write_text("---\ntags: [test]\n---\n# card\n")  # goes through /api/validate-yaml
    api.upload_folder(folder_path=folder, repo_id="ns/repo")
    assert api.list_repo_files("ns/repo") == ["README.md", "a/b/x.txt"]
    assert [e.path for e in api.list_repo_tree("ns/repo", path_in_repo="a")] == ["a/b"]
    assert api.create_repo("ns/repo", exist_ok=True).endswith("/ns/repo")
    path = hf_hub_download("ns/repo", "a/b/x.txt", endpoint=hub.url, cache_dir=hf_cache)
    assert open(path).read() == "x"


def test_each_commit_gets_a_new_sha_and_old_shas_stay_readable(hub, hf_cache):
    api = HfApi(endpoint=hub.url)
    api.create_repo("ns/repo")
    first = api.upload_file(path_or_fileobj=b"1", path_in_repo="f", repo_id="ns/repo").oid
    second = api.upload_file(path_or_fileobj=b"2", path_in_repo="f", repo_id="ns/repo").oid
    assert len({first, second}) == 2 and all(len(s) == 40 for s in (first, second))
    assert api.repo_info("ns/repo").sha == second
    old = hf_hub_download("ns/repo", "f", revision=first, endpoint=hub.url, cache_dir=hf_cache)
    new = hf_hub_download("ns/repo", "f", endpoint=hub.url, cache_dir=hf_cache)
    assert (open(old).read(), open(new).read()) == ("1", "2")
