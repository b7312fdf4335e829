"""A small in-memory Hugging Face Hub for tests: the unmodified ``huggingface_hub`` client talks to it.

It speaks just enough of the Hub protocol (checked against huggingface_hub 2.4.0, see docs/design.md §4)
for ``create_repo``, ``create_commit`` / ``upload_file`` in *regular* upload mode (file bytes travel
base64 inside the NDJSON commit: no LFS, no Xet), ``list_repo_files`` / ``list_repo_tree``,
``repo_info`` and ``hf_hub_download`` by branch or by pinned commit sha.

>>> hub = HubServer().start()
>>> api = HfApi(endpoint=hub.url)   # doctest: +SKIP
>>> hub.refuse_uploads = True       # the next commit answers 403
>>> hub.stop()                      # the port now refuses connections

Every commit gets a new 40-hex sha and an immutable snapshot; branches point at shas.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

_REPO_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}
_URL_PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/"}


def git_blob_sha(content: bytes) -> str:
    """The git object id of a regular file, what the Hub reports as a file's ``oid``."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


@dataclass
class _Repo:
    repo_id: str
    snapshots: dict[str, dict[str, bytes]] = field(default_factory=dict)  # sha -> {path: bytes}
    branches: dict[str, str] = field(default_factory=dict)  # branch -> sha
    history: list[str] = field(default_factory=list)  # shas, oldest first

    def resolve(self, revision: str) -> str | None:
        if revision in self.branches:
            return self.branches[revision]
        return revision if revision in self.snapshots else None


class _HubError(Exception):
    def __init__(
        self, status: int, message: str, code: str | None = None, body: dict | None = None, **headers
    ):
        super().__init__(message)
        self.status, self.body = status, body
        self.headers = {"X-Error-Code": code} if code else {}
        self.headers.update({key.replace("_", "-"): value for key, value in headers.items()})


class HubServer:
    """The server and its state. ``refuse_uploads`` makes commits fail; ``stop()`` makes the Hub unreachable."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.repos: dict[tuple[str, str], _Repo] = {}
        self.refuse_uploads = False
        # apply the next commit, then drop the connection without answering (a network failure mid-call)
        self.drop_after_commit = False
        # called (without the lock) when a commit arrives, before it is applied: lets a test slip in a
        # concurrent commit
        self.before_commit: Callable[[], None] | None = None
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request, for assertions
        self._lock = threading.Lock()
        self._counter = itertools.count()
        self._httpd = ThreadingHTTPServer((host, port), _make_handler(self))
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None
        self.url = f"http://{host}:{self._httpd.server_address[1]}"

    def start(self) -> HubServer:
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, args=(0.05,), name="hub-server", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the listening socket: new connections are refused."""
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
            self._thread = None
        self._httpd.server_close()

    # ----------------------------------------------------------------- state changes (used by the handler)

    def _new_sha(self, parent: str | None, files: dict[str, bytes]) -> str:
        digest = hashlib.sha1(f"{parent}:{next(self._counter)}".encode())
        for path in sorted(files):
            digest.update(path.encode() + b"\0" + git_blob_sha(files[path]).encode())
        return digest.hexdigest()

    def create_repo(self, repo_type: str, repo_id: str) -> tuple[bool, str]:
        url = f"{self.url}/{_URL_PREFIX[repo_type]}{repo_id}"
        with self._lock:
            if (repo_type, repo_id) in self.repos:
                return False, url
            repo = _Repo(repo_id)
            sha = self._new_sha(None, {})
            repo.snapshots[sha], repo.branches["main"] = {}, sha
            repo.history.append(sha)
            self.repos[(repo_type, repo_id)] = repo
            return True, url

    def commit(self, repo_type: str, repo_id: str, revision: str, lines: list[dict]) -> str:
        hook, self.before_commit = self.before_commit, None  # once
        if hook is not None:
            hook()
        with self._lock:
            if self.refuse_uploads:
                raise _HubError(403, "Uploads are refused by this test server (refuse_uploads=True).")
            repo = self._repo(repo_type, repo_id)
            if revision not in repo.branches:
                raise _HubError(
                    404, f"Branch {revision!r} not found (commits go to branches).", "RevisionNotFound"
                )
            head = repo.branches[revision]
            files = dict(repo.snapshots[head])
            for line in lines:
                key, value = line.get("key"), line.get("value", {})
                if key == "header":
                    parent = value.get("parentCommit")
                    if parent is not None and parent != head:
                        raise _HubError(
                            412, f"Parent commit {parent} is not the head of {revision} ({head})."
                        )
                elif key == "file":
                    if value.get("encoding") != "base64":
                        raise _HubError(400, "Only base64 file contents are supported.")
                    files[value["path"]] = base64.b64decode(value["content"])
                elif key == "deletedFile":
                    if files.pop(value["path"], None) is None:
                        raise _HubError(404, "A file with this name doesn't exist", "EntryNotFound")
                elif key == "deletedFolder":
                    prefix = value["path"].rstrip("/") + "/"
                    files = {p: c for p, c in files.items() if not p.startswith(prefix)}
                else:  # lfsFile and friends: this server only offers regular uploads
                    raise _HubError(400, f"Unsupported commit operation {key!r}.")
            sha = self._new_sha(head, files)
            repo.snapshots[sha], repo.branches[revision] = files, sha
            repo.history.append(sha)
            return sha

    def _repo(self, repo_type: str, repo_id: str) -> _Repo:
        repo = self.repos.get((repo_type, repo_id))
        if repo is None:
            raise _HubError(404, f"Repository {repo_id} not found.", "RepoNotFound")
        return repo

    def _snapshot(self, repo_type: str, repo_id: str, revision: str) -> tuple[str, dict[str, bytes]]:
        with self._lock:
            repo = self._repo(repo_type, repo_id)
            sha = repo.resolve(revision)
            if sha is None:
                raise _HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
            return sha, repo.snapshots[sha]


def _tree(files: dict[str, bytes], folder: str, recursive: bool) -> list[dict]:
    """Entries of ``folder`` (files and sub-folders), like the Hub's ``/tree`` listing."""
    prefix = folder.strip("/") + "/" if folder.strip("/") else ""
    entries: dict[str, dict] = {}
    for path, content in sorted(files.items()):
        if not path.startswith(prefix):
            continue
        parts = path[len(prefix) :].split("/")
        for depth in range(1, len(parts)):  # folders on the way
            folder_path = prefix + "/".join(parts[:depth])
            entries.setdefault(
                folder_path, {"type": "directory", "path": folder_path, "oid": "0" * 40, "size": 0}
            )
            if not recursive:
                break
        if recursive or len(parts) == 1:
            entries[path] = {"type": "file", "path": path, "size": len(content), "oid": git_blob_sha(content)}
    if prefix and not entries:
        raise _HubError(404, f"{folder} does not exist", "EntryNotFound")
    return list(entries.values())


def _make_handler(hub: HubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        # HTTP/1.0: one request per connection, so stop() leaves no kept-alive connection behind
        protocol_version = "HTTP/1.0"

        def log_message(self, format: str, *args) -> None:
            pass

        def do_HEAD(self) -> None:
            self._dispatch("HEAD")

        def do_GET(self) -> None:
            self._dispatch("GET")

        def do_POST(self) -> None:
            self._dispatch("POST")

        # ------------------------------------------------------------------------------- plumbing

        def _dispatch(self, method: str) -> None:
            hub.requests.append((method, self.path))
            try:
                self._route(method)
            except _HubError as err:
                body = err.body or {"error": str(err)}
                self._send(err.status, json.dumps(body).encode(), "application/json", err.headers)

        def _send(self, status: int, body: bytes, ctype: str, headers: dict | None = None) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, payload: object, status: int = 200) -> None:
            self._send(status, json.dumps(payload).encode(), "application/json")

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        # ------------------------------------------------------------------------------- routes

        def _route(self, method: str) -> None:
            url = urlsplit(self.path)
            # split before unquoting: a revision arrives quoted as one segment ("refs%2Fpr%2F1")
            seg = [unquote(s) for s in url.path.strip("/").split("/")]
            query = parse_qs(url.query)
            if method == "POST" and seg == ["api", "repos", "create"]:
                return self._create_repo()
            if method == "POST" and seg == ["api", "validate-yaml"]:
                return self._json({"errors": [], "warnings": []})
            if len(seg) >= 4 and seg[0] == "api" and seg[1] in _REPO_TYPES:
                repo_type, repo_id, rest = _REPO_TYPES[seg[1]], f"{seg[2]}/{seg[3]}", seg[4:]
                if method == "POST" and len(rest) == 2 and rest[0] == "preupload":
                    return self._preupload(repo_type, repo_id, rest[1])
                if method == "POST" and len(rest) == 2 and rest[0] == "commit":
                    return self._commit(repo_type, repo_id, rest[1])
                if method == "GET" and len(rest) >= 2 and rest[0] == "tree":
                    recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
                    _, files = hub._snapshot(repo_type, repo_id, rest[1])
                    return self._json(_tree(files, "/".join(rest[2:]), recursive))
                if method == "GET" and (not rest or (len(rest) == 2 and rest[0] == "revision")):
                    return self._repo_info(repo_type, repo_id, rest[1] if rest else "main")
            type_seg = seg[0] if seg and seg[0] in ("datasets", "spaces") else None
            seg = seg[1:] if type_seg else seg
            if method in ("HEAD", "GET") and len(seg) >= 5 and seg[2] == "resolve":
                repo_type = _REPO_TYPES[type_seg] if type_seg else "model"
                return self._resolve(repo_type, f"{seg[0]}/{seg[1]}", seg[3], "/".join(seg[4:]))
            raise _HubError(404, f"No route for {method} {url.path}")

        def _create_repo(self) -> None:
            payload = json.loads(self._body() or b"{}")
            name, organization = payload["name"], payload.get("organization")
            if not organization:
                raise _HubError(400, "This test server needs repo ids of the form 'namespace/name'.")
            created, url = hub.create_repo(payload.get("type") or "model", f"{organization}/{name}")
            if not created:  # exist_ok=True reads the url from the 409 body
                raise _HubError(
                    409, "You already created this model repo", body={"error": "exists", "url": url}
                )
            return self._json({"url": url, "name": f"{organization}/{name}"})

        def _preupload(self, repo_type: str, repo_id: str, revision: str) -> None:
            payload = json.loads(self._body())
            _, files = hub._snapshot(repo_type, repo_id, revision)
            answer = []
            for item in payload["files"]:
                existing = files.get(item["path"])
                # "regular": the client sends the bytes base64 inside the commit (no LFS, no Xet)
                answer.append(
                    {
                        "path": item["path"],
                        "uploadMode": "regular",
                        "shouldIgnore": False,
                        "oid": git_blob_sha(existing) if existing is not None else None,
                    }
                )
            self._json({"files": answer})

        def _commit(self, repo_type: str, repo_id: str, revision: str) -> None:
            lines = [json.loads(line) for line in self._body().splitlines() if line.strip()]
            sha = hub.commit(repo_type, repo_id, revision, lines)
            if hub.drop_after_commit:
                hub.drop_after_commit = False
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            url = f"{hub.url}/{_URL_PREFIX[repo_type]}{repo_id}/commit/{sha}"
            self._json({"commitOid": sha, "commitUrl": url, "pullRequestUrl": None})

        def _repo_info(self, repo_type: str, repo_id: str, revision: str) -> None:
            sha, files = hub._snapshot(repo_type, repo_id, revision)
            siblings = [{"rfilename": path} for path in sorted(files)]
            self._json(
                {"id": repo_id, "modelId": repo_id, "sha": sha, "private": False, "siblings": siblings}
            )

        def _resolve(self, repo_type: str, repo_id: str, revision: str, path: str) -> None:
            sha, files = hub._snapshot(repo_type, repo_id, revision)
            if path not in files:  # with the commit, so that the client caches the non-existence
                raise _HubError(404, f"Entry {path} not found at {sha}.", "EntryNotFound", X_Repo_Commit=sha)
            content = files[path]
            start = 0
            status = 200
            range_header = self.headers.get("Range", "")
            if range_header.startswith("bytes=") and range_header[6:].split("-")[0].isdigit():
                start, status = int(range_header[6:].split("-")[0]), 206  # resume of a partial download
            # a content-derived ETag: the same bytes keep the same cache blob across commits
            headers = {"X-Repo-Commit": sha, "ETag": f'"{git_blob_sha(content)}"'}
            self._send(status, content[start:], "application/octet-stream", headers)

    return Handler
