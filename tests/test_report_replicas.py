"""`nanscan report` of a replica-mismatch bundle set, written by three real DDP ranks on CPU (gloo) with one bit of
rank 2's weights flipped: the terminal and the HTML name the odd rank and the tensor that differed (as INCIDENT.md
and --json do), show no empty table of non-finite tensors, and say why replay does not apply instead of "not run
yet"."""

from __future__ import annotations

import json
import re
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner
from torch import nn

from spawn_ranks import spawn

from nanscan import Monitor, NonFiniteError
from nanscan.cli.main import main
from nanscan.incident import REPLICA_MISMATCH

WORLD = 3
ODD_RANK = 2
FLIP_STEP = 2
FLIPPED = "param:0.weight"
SPAWN_TIMEOUT_S = 300  # startup of 3 processes importing torch on 2 shared cores is most of it

pytestmark = [pytest.mark.slow, pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)]


def _train(rank: int, world: int, store: str, out: str) -> None:
    """One short DDP run whose rank ODD_RANK has a low mantissa bit of its first weight flipped at FLIP_STEP: the
    value stays finite, the replicas differ (nanscan.runtime.replicas NOTE: [replica agreement])."""
    from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: PLC0415 - in the spawned rank

    torch.set_num_threads(1)  # three processes share the cores
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=90))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    mon = Monitor(ddp, opt, bundle_dir=Path(out) / "bundles", run_id="flip")
    result = {"bundle": None}
    for step in range(FLIP_STEP + 2):
        if step == FLIP_STEP and rank == ODD_RANK:
            with torch.no_grad():
                model[0].weight.view(-1).view(torch.int32)[0] ^= 1 << 3
        g = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        try:
            mon.check(batch={"x": x, "y": y}, loss=loss)
        except NonFiniteError as exc:
            result["bundle"] = str(exc.bundle_path)
            break
        opt.step()
    mon.close()
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))


@pytest.fixture(scope="module")
def replica_set(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("replica-report")
    spawn(_train, WORLD, WORLD, out, timeout_s=SPAWN_TIMEOUT_S, label="a flipped replica")
    (bundle,) = {json.loads((out / f"rank{r}.json").read_text())["bundle"] for r in range(WORLD)}
    assert bundle is not None, "the flipped bit was not caught"
    return Path(bundle)


def test_the_json_names_the_odd_rank_and_tensor(replica_set):
    result = CliRunner().invoke(main, ["report", str(replica_set), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["category"] == REPLICA_MISMATCH and summary["nonfinite_tensors"] == []
    replicas = summary["distributed"]["replicas"]
    assert replicas["odd_ranks"] == [ODD_RANK] and FLIPPED in replicas["tensors"]


def test_the_terminal_names_the_odd_rank_and_tensor_with_no_empty_table(replica_set):
    result = CliRunner().invoke(main, ["report", str(replica_set)], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert f"replicas differ at step {FLIP_STEP}" in out
    assert f"rank {ODD_RANK} is the odd one out" in out and FLIPPED in out
    assert "non-finite tensors by module" not in out  # no tensor was non-finite: no table of them
    assert "replay: not run yet" not in out
    assert "replay: does not apply" in out


def test_the_html_names_the_odd_rank_and_tensor_with_no_empty_table(replica_set, tmp_path):
    page_path = tmp_path / "replicas.html"
    result = CliRunner().invoke(main, ["report", str(replica_set), "--html", str(page_path)])
    assert result.exit_code == 0, result.output
    page = page_path.read_text()
    # the report's own sections, before the incident note (which words the same facts in its own way)
    report = page.split("<h2>Incident note</h2>")[0]
    assert f"rank {ODD_RANK} is the odd one out" in report and FLIPPED in report
    assert "Non-finite tensors by module" not in report
    assert not re.search(r"<table><tr>(<th[^>]*>[^<]*</th>)+</tr></table>", report)  # a table with no rows
    assert "replay: not run yet" not in report and "replay: does not apply" in report
