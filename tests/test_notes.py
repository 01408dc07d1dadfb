"""Notes: deterministic bytes, honest labels, regressions, commits only on change, no leaks."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.table_files import provenance, read_table, to_table, write_table
from flows import REPO
from flows.analysis.backtest_store import refresh
from flows.analysis.reference import project_host
from flows.inventory.files import load_inventory, update_host
from flows.inventory.hosts import Inventory
from flows.inventory.scrub import leaks
from flows.notes.gather import gather
from flows.notes.publish import NotesError, commit_notes, render_notes
from flows.notes.summary import notes_message, summary_lines
from flows.store.store import Store
from support.runs import write_run

SECRETS = {"address": "10.20.30.40", "user": "alice", "key_file": "/home/alice/.ssh/id_ed25519"}


@pytest.fixture(scope="module")
def secret_inv(tmp_path_factory: pytest.TempPathFactory) -> Inventory:
    """The shipped inventory with real-looking address, user and key path, which must never surface."""
    hosts = tmp_path_factory.mktemp("secret_inv") / "hosts"
    shutil.copytree(REPO / "hosts", hosts)
    for name in ("h200", "b300"):
        update_host(hosts, name, **SECRETS)
    return load_inventory(hosts)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory, secret_inv: Inventory) -> tuple[Store, Path]:
    tmp = tmp_path_factory.mktemp("notes")
    write_run(tmp / "art" / "reference" / "h200")
    store = Store(str(tmp / "art"))
    refresh(store, secret_inv, "h200")
    render_notes(store, secret_inv, tmp / "docs")
    return store, tmp / "docs" / "notes"


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_pages_and_plots_exist(rendered: tuple[Store, Path]) -> None:
    _, notes = rendered
    names = set(_files(notes))
    assert {"README.md", "h200.md", "b300.md", "pro6000.md"} <= names
    for host in ("h200", "b300", "pro6000"):
        for plot in ("moe_us_per_token", "moe_pct_peak_bw", "roofline", "amdahl"):
            assert f"{host}/{plot}.png" in names
    index = (notes / "README.md").read_text()
    assert "| [b300](b300.md) |" in index and "released, 2026-11-01" in index and "| projected |" in index


def test_render_is_byte_identical_in_process_and_from_the_cli(rendered: tuple[Store, Path], secret_inv: Inventory,
                                                              tmp_path: Path) -> None:
    store, notes = rendered
    render_notes(store, secret_inv, tmp_path / "again")
    assert _files(tmp_path / "again" / "notes") == _files(notes)
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    argv = ["notes", "--artifacts", store.base, "--hosts", str(secret_inv.dir), "--docs", str(tmp_path / "cli")]
    cli = subprocess.run([sys.executable, "-c", "from flows.cli.app import app; app()", *argv], env=env,
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert cli.returncode == 0, cli.stderr
    assert "b300: projected" in cli.stdout and "h200: measured" in cli.stdout
    assert _files(tmp_path / "cli" / "notes") == _files(notes)


def test_projected_page_never_calls_itself_measured(rendered: tuple[Store, Path]) -> None:
    _, notes = rendered
    for host in ("b300", "pro6000"):
        text = (notes / f"{host}.md").read_text()
        title, _, status = text.splitlines()[:3]
        assert title.endswith(": projected") and "measured" not in title
        assert status.startswith("**Data: projected** from h200") and "measured" not in status
        assert "Data: measured" not in text
        assert "## Projection" in text and "Assumptions:" in text and "band (us)" in text
    h200 = (notes / "h200.md").read_text()
    assert h200.splitlines()[0].endswith(": measured") and "plateau M = " in h200
    assert "## Time outside kernels" in h200 and "Time outside kernels" not in (notes / "b300.md").read_text()


def test_outside_kernel_share_is_the_profiled_rest_of_the_step(rendered: tuple[Store, Path]) -> None:
    store, notes = rendered
    rows = read_table(Path(store.base) / "reference" / "h200" / "e2e.arrow").to_pylist()
    [e] = [e for e in rows if e["concurrency"] == 1]
    share = 100 * e["outside_ms"] / (e["kernel_ms"] + e["outside_ms"])
    row = f"| B={e['budget']} c=1 | {e['kernel_ms']:.2f} | {e['outside_ms']:.2f} | {share:.0f}% |"
    assert row in (notes / "h200.md").read_text()


def test_summary_lines(rendered: tuple[Store, Path], secret_inv: Inventory) -> None:
    store, _ = rendered
    lines = summary_lines(store, secret_inv)
    # the 2-layer e2e figures are not headlines: the headline says plainly there is no full-depth row yet
    assert any(line.startswith("Measured h200: full model: no full-depth e2e rows yet") and
               "MoE W4A16 decode " in line and "% of copy bandwidth" in line for line in lines)
    assert any(line.startswith("Projected b300 from h200: full model: no full-depth") for line in lines)
    assert not any("tok/s" in line for line in lines)


def test_regression_against_previous_run_is_flagged(tmp_path: Path, secret_inv: Inventory) -> None:
    write_run(tmp_path / "art" / "reference" / "h200")
    store = Store(str(tmp_path / "art"))
    slower = write_run(tmp_path / "pulled", run_id="h200-2", bw=3000.0, started_at="2026-10-21T10:00:00Z")
    store.ingest("h200", "h200-2", slower)
    refresh(store, secret_inv, "h200")
    [h200] = [v for v in gather(store, secret_inv) if v.name == "h200"]
    assert [r.run_id for r in h200.measured] == ["h200-20261020-1", "h200-2"]
    render_notes(store, secret_inv, tmp_path / "docs")
    text = (tmp_path / "docs" / "notes" / "h200.md").read_text()
    assert "Run h200-2 against h200-20261020-1" in text and "REGRESSION" in text


def test_stored_projection_is_shown_when_the_reference_is_gone(tmp_path: Path, secret_inv: Inventory) -> None:
    write_run(tmp_path / "art" / "reference" / "h200")
    store = Store(str(tmp_path / "art"))
    run_id = project_host(store, secret_inv, "b300")
    shutil.rmtree(tmp_path / "art" / "reference")
    views = {v.name: v for v in gather(store, secret_inv)}
    assert views["b300"].kind == "projected" and views["b300"].latest.run_id == run_id
    assert views["pro6000"].kind == "no data" and "no projection of pro6000 is stored" in views["pro6000"].missing
    # rendering never projects: without the reference, refresh cannot, and says why
    assert "artifacts/reference/h200" in refresh(store, secret_inv, "h200")["pro6000"]


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


@pytest.mark.integration
def test_commit_only_on_change_and_nothing_leaks(tmp_path: Path, secret_inv: Inventory) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "other.txt").write_text("untouched\n")
    write_run(repo / "artifacts" / "reference" / "h200")
    store = Store(str(repo / "artifacts"))

    def publish() -> str | None:
        refresh(store, secret_inv, "h200")
        paths = render_notes(store, secret_inv, repo / "docs")
        return commit_notes(repo, paths, notes_message(store, secret_inv), secret_inv)

    first = publish()
    assert first and publish() is None                      # same inputs: no new commit
    store.ingest("h200", "h200-2", write_run(tmp_path / "pulled", run_id="h200-2", bw=3000.0,
                                            started_at="2026-10-21T10:00:00Z"))
    second = publish()
    assert second and second != first
    changed = _git(repo, "show", "--name-only", "--format=", second).split()
    assert changed and all(p.startswith("docs/notes/") for p in changed)
    assert "other.txt" in _git(repo, "status", "--porcelain")  # never swept into a notes commit
    log = _git(repo, "log", "--format=%B")
    assert "Measured h200: full model: " in log and "Projected b300 from h200:" in log
    with pytest.raises(NotesError, match="only docs/ and hosts/"):
        commit_notes(repo, [repo / "other.txt"], "x")
    # grep everything that was written or committed for the inventory's address, user and key path
    authors = _git(repo, "log", "--format=%an %ae %cn %ce")
    texts = [p.read_text() for p in (repo / "docs").rglob("*.md")] + [log, authors]
    blobs = [p.read_bytes() for p in (repo / "docs").rglob("*.png")]
    for secret in SECRETS.values():
        assert not any(secret in t for t in texts)
        assert not any(secret.encode() in b for b in blobs)
    assert leaks("ssh alice@10.20.30.40 -i /home/alice/.ssh/id_ed25519", secret_inv) == [
        "a home or key path", "a login (user@host)", "an IPv4 address", "the address of b300",
        "the address of h200", "the key path of b300", "the key path of h200", "the user of b300",
        "the user of h200"]
    # a message quoting an SSH error is redacted before it is committed
    (repo / "docs" / "extra.md").write_text("x\n")
    third = commit_notes(repo, [repo / "docs" / "extra.md"], "lost alice@10.20.30.40: key /home/alice/.ssh/id_ed25519")
    body = _git(repo, "log", "-1", "--format=%B", third)
    assert "[redacted]" in body and not any(v in body for v in SECRETS.values())


def test_cli_errors_are_one_line_exit_2(tmp_path: Path) -> None:
    (tmp_path / "hosts" / "specs").mkdir(parents=True)
    (tmp_path / "hosts" / "bad.yaml").write_text("name: bad\nport: nope\n")
    from typer.testing import CliRunner

    from flows.cli.app import app
    res = CliRunner().invoke(app, ["notes", "--artifacts", str(tmp_path / "art"), "--hosts",
                                   str(tmp_path / "hosts"), "--docs", str(tmp_path / "docs")])
    assert res.exit_code == 2 and "bad.yaml" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(app, ["backtest", "--artifacts", str(tmp_path / "art"), "--hosts", str(REPO / "hosts")])
    assert res.exit_code == 0 and "no measured data" in res.output


# -- hostile hosts --------------------------------------------------------------------------------

def _rewrite(run_dir: Path, table: str, change) -> None:
    """Rewrite one table of a written run, each row passed through change(row) -> row."""
    t = read_table(run_dir / f"{table}.arrow")
    write_table(run_dir, to_table(table, [change(dict(r)) for r in t.to_pylist()], provenance(t)))


def _hostile_run(out: Path, host: str, run_id: str) -> Path:
    """A run whose host sent markup, an address as its GPU name and a kernel name mathtext cannot parse."""
    write_run(out, host=host, run_id=run_id, gpu="GPU-BOX.Lab.Internal")
    _rewrite(out, "runs", lambda r: {**r, "driver": "570|<img src=x onerror=alert(1)>\n| injected |",
                                     "cuda": "1.2.3.4", "torch": "10\u200b.20.30.40",
                                     "python": "fe80::1ff:fe23:4567:890a", "device": "![x](http://evil.example/p.png)",
                                     "profile": "full|<b>x</b>", "payload_hash": "ab|c\n| d"})
    _rewrite(out, "kernels", lambda r: r if r["kernel"] == "moe_w4a16" else
             {**r, "kernel": r"$\frac{$" + r["kernel"], "impl": r["impl"] + "[a](https://evil.example)"})
    _rewrite(out, "e2e", lambda r: {**r, "config": "k2\n# heading <b>x</b>"})
    return out


def _cells(line: str) -> int:
    return len(re.findall(r"(?<!\\)\|", line))


def test_one_hostile_host_cannot_break_or_block_the_fleet_notes(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    shutil.copytree(REPO / "hosts", hosts)
    update_host(hosts, "h200", address="gpu-box.lab.internal", user="alice", key_file="/home/alice/.ssh/id_ed25519")
    update_host(hosts, "b300", address="b300")  # a DNS alias equal to the host's own name
    inv = load_inventory(hosts)
    write_run(tmp_path / "art" / "reference" / "h200")
    store = Store(str(tmp_path / "art"))
    store.ingest("evil", "evil-1", _hostile_run(tmp_path / "pulled", "evil", "evil-1"))
    render_notes(store, inv, tmp_path / "docs")
    notes = tmp_path / "docs" / "notes"
    page = (notes / "evil.md").read_text()
    for bad in ("1.2.3.4", "fe80::", "gpu-box", "GPU-BOX", "\n# heading"):
        assert bad not in page, bad
    for markup in (r"(?<!\\)<(img|b)", r"(?<!\\)\]\(http", r"(?<!\\)!(?<!\\)\[x"):  # HTML, link, image
        assert not re.search(markup, page), markup
    assert "\\[redacted\\]" in page and "\\<img" in page                      # shown as text
    for block in page.split("\n\n"):
        rows = [line for line in block.splitlines() if line.startswith("|")]
        assert len({_cells(r) for r in rows}) <= 1, block                       # no row gained a cell
    assert {p.name for p in (notes / "evil").glob("*.png")} >= {"roofline.png", "amdahl.png"}
    assert "b300" in (notes / "b300.md").read_text() and "b300" in (notes / "README.md").read_text()


def test_a_reference_host_name_cannot_write_outside_docs(tmp_path: Path, secret_inv: Inventory) -> None:
    write_run(tmp_path / "art" / "reference" / "h200")
    write_run(tmp_path / "art" / "reference" / "odd", host="../../escaped", run_id="odd-1")
    store = Store(str(tmp_path / "art"))
    written = render_notes(store, secret_inv, tmp_path / "docs")
    assert all(p.resolve().is_relative_to((tmp_path / "docs" / "notes").resolve()) for p in written)
    assert not list(tmp_path.glob("escaped*")) and not list(tmp_path.glob("*/escaped*"))


def _repo_with_inventory(tmp_path: Path) -> Path:
    """A git repo whose committed hosts/ are the shipped files, committed by an operator."""
    repo = tmp_path / "repo"
    shutil.copytree(REPO / "hosts", repo / "hosts", ignore=shutil.ignore_patterns(".locks"))
    _git(repo, "init", "-q")
    _git(repo, "-c", "user.name=op", "-c", "user.email=op@localhost", "add", "hosts")
    _git(repo, "-c", "user.name=op", "-c", "user.email=op@localhost", "commit", "-q", "-m", "inventory")
    return repo


@pytest.mark.integration
def test_notes_commit_records_only_the_status_fields_of_a_host_file(tmp_path: Path) -> None:
    repo = _repo_with_inventory(tmp_path)
    hosts = repo / "hosts"
    update_host(hosts, "h200", **SECRETS)                                     # the operator's edit, never committed
    (hosts / "newbox.yaml").write_text((hosts / "h200.yaml").read_text().replace("name: h200", "name: newbox"))
    (repo / "other.txt").write_text("staged by the operator\n")
    _git(repo, "add", "other.txt")
    update_host(hosts, "h200", unreachable_runs=2)                            # what the flow writes back
    secret_inv = load_inventory(hosts)
    write_run(repo / "artifacts" / "reference" / "h200")
    store = Store(str(repo / "artifacts"))
    paths = render_notes(store, secret_inv, repo / "docs")
    sha = commit_notes(repo, [*paths, hosts / "h200.yaml", hosts / "newbox.yaml"], notes_message(store, secret_inv), secret_inv)
    assert sha
    committed = _git(repo, "show", f"{sha}:hosts/h200.yaml")
    assert "unreachable_runs: 2" in committed and "address: REPLACE-ME.example" in committed
    assert "# placeholder: refused before any network activity until edited" in committed  # comments kept
    assert set(_git(repo, "show", "--name-only", "--format=", sha).split()) - {p for p in
            _git(repo, "show", "--name-only", "--format=", sha).split() if p.startswith("docs/notes/")} \
        == {"hosts/h200.yaml"}                                                # not the untracked newbox.yaml
    history = _git(repo, "log", "-p", "--all")
    assert not any(v in history for v in SECRETS.values())
    assert SECRETS["address"] in (hosts / "h200.yaml").read_text()            # the working file is untouched
    status = _git(repo, "status", "--porcelain").splitlines()
    assert " M hosts/h200.yaml" in status and "A  other.txt" in status and "?? hosts/newbox.yaml" in status
    # every staged file goes through the leak check: a status value and a page that would leak
    update_host(hosts, "h200", presented_host_key_fingerprint="seen from 10.9.8.7")
    with pytest.raises(NotesError, match=r"hosts/h200\.yaml: it would reveal an IPv4 address"):
        commit_notes(repo, [hosts / "h200.yaml"], "x", secret_inv)
    (repo / "docs" / "notes" / "extra.md").write_text("from gpu at 10.9.8.7\n")
    with pytest.raises(NotesError, match=r"docs/notes/extra\.md: it would reveal an IPv4 address"):
        commit_notes(repo, [repo / "docs" / "notes" / "extra.md"], "x", secret_inv)
    assert _git(repo, "rev-parse", "HEAD").strip() == sha


def test_dense_gemms_get_their_own_table(tmp_path: Path, secret_inv: Inventory) -> None:
    """Dense GEMM points show as one row per (op, tp) with us at each M and the share of the roofline,
    never among the attention and tree kernels."""
    from engine.config import K2
    from engine.costs import dense_op_cost, dense_ops

    ref = write_run(tmp_path / "art" / "reference" / "h200")
    kern = read_table(ref / "kernels.arrow")
    prov = provenance(kern)
    ops = {op.name: op for op in dense_ops(K2, 8)}
    dense = []
    for name, t_us in (("o", 20.0), ("lm_head", 80.0)):
        for m in (1, 256):
            nbytes, flops = dense_op_cost(ops[name], m)
            dense.append({"run_id": prov["run_id"], "kernel": "dense_gemm", "op": name, "impl": "torch",
                          "dtype": "bfloat16", "device": "cuda", "M": m, "N": ops[name].n, "K": ops[name].k,
                          "batch": 1, "tp": 8, "time_us_p50": t_us * (1 + m / 256), "bytes": nbytes,
                          "flops": flops, "source": "measured"})
    write_table(ref, to_table("kernels", kern.to_pylist() + dense, prov))
    render_notes(Store(str(tmp_path / "art")), secret_inv, tmp_path / "docs")
    page = (tmp_path / "docs" / "notes" / "h200.md").read_text()
    section = page.split("### Dense GEMMs", 1)[1].split("\n## ", 1)[0]
    assert "| op | tp | N x K | M=1 us | M=256 us | roofline % |" in section
    head = next(r for r in dense if r["op"] == "lm_head" and r["M"] == 1)
    pct = head["bytes"] / (4300.0 * 1e3) / head["time_us_p50"] * 100  # the run's own copy bandwidth
    assert f"| lm_head | 8 | 20480 x 7168 | 80.3 | 160.0 | " in section and f"-{pct:.0f} |" in section
    attention = page.split("## Attention and tree kernels", 1)[1].split("### Dense GEMMs", 1)[0]
    assert "dense_gemm" not in attention and "lm_head" not in attention


def test_a_run_whose_mla_points_ran_the_gluon_kernel_renders(tmp_path: Path, inv: Inventory) -> None:
    """An H200 run names impl "gluon" on the MLA points where the Gluon kernel ran (kernels.ops.mla_impl):
    the measured page shows it, the family rules take it as the engine's own kernel, and the hosts
    projected from that run still render."""
    from engine.rows import table_rows
    from flows.analysis.families import label, preferred

    ref = write_run(tmp_path / "art" / "reference" / "h200")
    _rewrite(ref, "kernels", lambda r: {**r, "impl": "gluon"} if r["kernel"] == "mla_tree_attention" else r)
    rows = table_rows(read_table(ref / "kernels.arrow"), "kernels")
    mla = [r for r in rows if r.kernel == "mla_tree_attention"]
    assert mla and {label(r) for r in preferred(mla)} == {"mla_tree_attention/gluon"}
    store = Store(str(tmp_path / "art"))
    refresh(store, inv, "h200")
    render_notes(store, inv, tmp_path / "docs")
    page = (tmp_path / "docs" / "notes" / "h200.md").read_text()
    attention = page.split("## Attention and tree kernels", 1)[1].split("### Dense GEMMs", 1)[0]
    assert "| mla_tree_attention | gluon |" in attention
    for host in ("b300", "pro6000"):
        assert "mla_tree_attention" in (tmp_path / "docs" / "notes" / f"{host}.md").read_text()
