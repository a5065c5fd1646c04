"""Submission refuses a step's `gpu_memory_gib` larger than every node's GPU memory, where every
node's is known (422 naming the field; nothing stored), like `gpus` beyond the largest node."""

from __future__ import annotations

from pathlib import Path

import yaml
from fastapi.testclient import TestClient

from lowtide.wiring import Embedded
from support import embedded


def submit(lt: Embedded, need: float) -> tuple[int, list[str]]:
    _, token = lt.store.create_token(
        name="alice", owner="alice", role="user", now=lt.clock.now(), teams=["nlp"]
    )
    doc = {
        "name": "j",
        "team": "nlp",
        "steps": [{"name": "s", "command": ["x"], "gpus": 1, "gpu_memory_gib": need}],
    }
    headers = {"Content-Type": "application/yaml", "Authorization": f"Bearer {token}"}
    r = TestClient(lt.app).post("/v1/jobs", content=yaml.safe_dump(doc), headers=headers)
    errors = r.json().get("errors", []) if r.status_code >= 400 else []
    return r.status_code, [f"{e['loc']}: {e['msg']}" for e in errors]


def test_a_need_above_every_nodes_gpu_memory_is_refused_naming_the_field(tmp_path: Path) -> None:
    nodes = [
        {"name": "node-a", "gpus": 4, "gpu_memory_gib": 80},
        {"name": "node-b", "gpus": 2, "gpu_memory_gib": 40},
    ]
    lt = embedded(tmp_path, nodes=nodes)
    try:
        assert submit(lt, 81) == (
            422,
            ["steps[0].gpu_memory_gib: 81 GiB per GPU requested but no node's GPUs have more than 80 GiB"],
        )
        assert lt.store.list_jobs() == []
        status, _ = submit(lt, 80)
        assert status == 201
    finally:
        lt.close()


def test_with_a_node_of_unknown_gpu_memory_any_need_is_accepted(tmp_path: Path) -> None:
    nodes = [{"name": "node-a", "gpus": 4, "gpu_memory_gib": 80}, {"name": "node-b", "gpus": 2}]
    lt = embedded(tmp_path, nodes=nodes)
    try:
        status, errors = submit(lt, 200)
        assert (status, errors) == (201, [])
    finally:
        lt.close()
