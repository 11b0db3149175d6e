"""What `cluster submit` uploads as the job's working directory: the project, not its caches
or virtual environment (packed by Ray's own code, as the job server receives it)."""

from __future__ import annotations

import zipfile
from pathlib import Path

from ray._private.runtime_env.packaging import create_package

from weightsync.tools.cluster_cli import UPLOAD_EXCLUDES, job_runtime_env

CACHES = [".venv", ".hypothesis", ".pytest_cache", ".mypy_cache", ".ruff_cache", "__pycache__", "pkg/__pycache__"]


def test_the_upload_leaves_out_caches_and_the_venv_and_keeps_the_project(tmp_path: Path) -> None:
    project = tmp_path / "project"
    for folder in CACHES:
        (project / folder).mkdir(parents=True)
        (project / folder / "junk.bin").write_bytes(b"x")
    (project / "pkg").mkdir(exist_ok=True)
    (project / "pkg" / "module.py").write_text("x = 1\n")
    (project / "README.md").write_text("hi\n")
    env = job_runtime_env(str(project))
    assert env["working_dir"] == str(project)
    package = tmp_path / "upload.zip"
    create_package(str(project), package, include_gitignore=True, excludes=env["excludes"])
    names = set(zipfile.ZipFile(package).namelist())
    assert {"pkg/module.py", "README.md"} <= names
    leaked = [n for n in names if any(n.startswith(folder + "/") for folder in CACHES)]
    assert not leaked, f"uploaded caches: {leaked}"


def test_runtime_env_json_is_merged_over_the_defaults() -> None:
    env = job_runtime_env(".", '{"env_vars": {"A": "1"}}')
    assert env == {"working_dir": ".", "excludes": list(UPLOAD_EXCLUDES), "env_vars": {"A": "1"}}
