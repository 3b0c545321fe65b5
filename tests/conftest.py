"""Shared fixtures."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def migrated_mlflow_db(tmp_path_factory) -> Path:
    """An empty MLflow SQLite store whose schema is created once per session: the migrations
    cost seconds, so tests that are not about creating a store copy this one (`mlflow_db`)."""
    import mlflow

    path = tmp_path_factory.mktemp("mlflow_template") / "mlflow.db"
    mlflow.MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def mlflow_db(migrated_mlflow_db, tmp_path) -> Path:
    """A fresh copy of the migrated store at `<tmp>/store/mlflow.db` (artifacts go beside it)."""
    path = tmp_path / "store" / "mlflow.db"
    path.parent.mkdir()
    shutil.copyfile(migrated_mlflow_db, path)
    return path
