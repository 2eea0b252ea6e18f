"""A fix refuted from the snapshot is replayed again from the run's start only where its
effect builds up over the run and the replay fits the budget (diagnose/rewind.py); the
terminal says where and why before the fixes replay."""

from __future__ import annotations

import json
import re
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from nandoctor.causes.ranking import Replay, rerank
from nandoctor.causes.unit import Change, Fix
from nandoctor.cli import app
from nandoctor.diagnose.plans import REACH, Reach, plan
from nandoctor.diagnose.rewind import Replaying, Rewind
from nandoctor.diagnose.verify import FixOutcome, check, horizon
from nandoctor.report.types import Cause
from nandoctor.runtime.fast_run import fast_run
from nandoctor.runtime.snapshot import SnapshotStore
from nandoctor.setup.load import load_config
from nandoctor.setup.session import build_session
from tests.causes.test_rules import case
from tests.helpers.paths import CONFIGS
from tests.helpers.project import TRAIN_PY, base_config

SEED = CONFIGS / "seed-fp16-nan.yaml"
# NB: the suite's small MLP (tests/helpers/project.py), its learning rate multiplied 3000-fold at
# step 20 (a scheduler gone wrong): the weights blow up and the loss overflows about 20
# steps later, past the snapshot every 8 steps takes
LR_JUMP = base_config(
    optimizer={"name": "SGD", "lr": 0.01, "momentum": 0.9},
    scheduler={"name": "MultiStepLR", "milestones": [20], "gamma": 3000.0},
    steps=120,
    snapshot={"every": 8},
)


@pytest.fixture(scope="module")
def lr_jump(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("lr-jump")
    (folder / "train.py").write_text(textwrap.dedent(TRAIN_PY))
    (folder / "config.yaml").write_text(yaml.safe_dump(LR_JUMP, sort_keys=False))
    return folder / "config.yaml"


@pytest.fixture(scope="module")
def late_snapshot(lr_jump):
    """The run, its case, and the newest snapshot before its failure: a few steps before
    it, too late for a fix that acts over the run."""
    loaded = load_config(lr_jump)
    session = build_session(loaded)
    store = SnapshotStore(session, every=8)
    failing = fast_run(session, loaded.config.steps, store=store).failure.step
    c = case("aten.addmm.default", "forward")
    snapshot = store.resume_point(failing)
    assert 20 < snapshot.step < failing
    return loaded, replace(c, first=replace(c.first, step=failing)), snapshot


def checked(late_snapshot, cause_id: str, rewind: Rewind) -> tuple[Cause, list[Replaying]]:
    """The cause's fixes replayed as `rewind` says; the replays, as they started."""
    cause, _, replays = outcome_of(late_snapshot, cause_id, rewind)
    return cause, replays


def outcome_of(
    late_snapshot, cause_id: str, rewind: Rewind
) -> tuple[Cause, FixOutcome, list[Replaying]]:
    loaded, c, snapshot = late_snapshot
    replays: list[Replaying] = []
    rewind = replace(rewind, on_replay=replays.append)
    cause = Cause(cause_id, "", 0.5)
    verified, outcome = check(cause, c, loaded, time.perf_counter() + 120, snapshot, rewind)
    return verified, outcome, replays


def test_a_refuted_local_fix_is_not_replayed_from_the_start(late_snapshot):
    """Skipping batches that hold NaN acts on the step that failed: this run's batches are
    finite, so from the snapshot it fails all the same, and that settles it."""
    _, _c, snapshot = late_snapshot
    cause, replays = checked(late_snapshot, "nonfinite-input", Rewind())
    assert [(r.start, r.resumed) for r in replays] == [(snapshot.step, True)]
    assert cause.verified is False
    assert re.fullmatch(
        rf"with batches holding NaN or inf skipped, applied from step {snapshot.step} "
        r"\(resumed from a snapshot\), the run still went non-finite at step \d+ \(phase "
        rf"[\w ]+\); refuted from step {snapshot.step}: the fix acts at the failing step, so "
        r"a replay from step 0 would show no more \(--verify-from-start replays it from "
        r"there\)",
        cause.verification,
    ), cause.verification


def test_verify_from_start_replays_a_refuted_local_fix_from_step_0(late_snapshot):
    _, _, snapshot = late_snapshot
    cause, replays = checked(late_snapshot, "nonfinite-input", Rewind(always=True))
    assert [(r.start, r.resumed) for r in replays] == [(snapshot.step, True), (0, False)]
    assert cause.verified is False
    assert "; applied from step 0, the run still went non-finite at step" in cause.verification
    assert "refuted from step" not in cause.verification


def test_a_refuted_history_fix_within_the_budget_is_replayed_from_step_0(late_snapshot):
    """A 10x smaller rate from the snapshot is too late (the weights have blown up
    already); it is replayed again from step 0, whatever that replay then shows."""
    _, _, snapshot = late_snapshot
    cause, replays = checked(late_snapshot, "learning-rate-too-high", Rewind())
    assert [(r.start, r.resumed) for r in replays] == [(snapshot.step, True), (0, False)]
    assert f"applied from step {snapshot.step} (resumed from a snapshot), the run still" in (
        cause.verification
    )
    assert "; applied from step 0, " in cause.verification


def test_a_refuted_history_fix_over_the_budget_says_it_was_refuted_from_the_snapshot(
    late_snapshot,
):
    """The budget already spent (`by` in the past) and the replay from step 0 no short one
    (a second a step, and no floor of steps): it is not made, and the sentence offers the
    option that makes it."""
    _, c, snapshot = late_snapshot
    spent = Rewind(by=time.perf_counter() - 1, step_seconds=1.0, short=(0, 10.0))
    cause, outcome, replays = outcome_of(late_snapshot, "learning-rate-too-high", spent)
    assert outcome.replay is Replay.REFUTED_LATE  # too late to tell, not refuted
    assert [(r.start, r.resumed) for r in replays] == [(snapshot.step, True)]
    assert cause.verified is False
    steps = c.first.step + horizon(c) + 1
    assert cause.verification.endswith(
        f"; refuted from step {snapshot.step} only: a replay from step 0 ({steps} steps) "
        "would not fit the time budget (--verify-from-start replays it)"
    ), cause.verification
    _, replays = checked(late_snapshot, "learning-rate-too-high", replace(spent, always=True))
    assert [r.start for r in replays] == [snapshot.step, 0]
    _, replays = checked(late_snapshot, "learning-rate-too-high", replace(spent, short=(steps, 0)))
    assert [r.start for r in replays] == [snapshot.step, 0]  # a short one is made all the same


def test_a_history_fix_refuted_late_ranks_above_a_refuted_one(late_snapshot):
    """A rate lowered a few steps before the failure, with no replay from step 0 to say
    more, is no refutation of the rate: it ranks with a fix that stopped the run learning
    (x0.8), above a fix refuted from the start, whatever their rules' confidence; a local
    fix refuted from the snapshot is refuted (x0.5)."""
    _, local, _ = outcome_of(late_snapshot, "nonfinite-input", Rewind())
    assert local.replay is Replay.REFUTED
    lr = Cause("learning-rate-too-high", "", 0.5)
    clip = Cause("exploding-gradients", "", 0.9)
    ranked = rerank([(clip, Replay.REFUTED), (lr, Replay.REFUTED_LATE)])
    assert [(c.id, c.confidence) for c in ranked] == [
        ("learning-rate-too-high", 0.4),
        ("exploding-gradients", 0.45),
    ]


def test_how_far_a_fix_reaches_is_data_for_every_change():
    """A rate, a clip or a dtype acts on every update of the run; an eps raised or a batch
    skipped on the failing step; weights zeroed where they are loaded. Patches and the
    origin guard rewrite the failing op: local."""
    assert set(REACH) == set(Change)
    assert {c for c, r in REACH.items() if r is Reach.HISTORY} == {
        Change.SMALLER_LR, Change.CLIP_GRAD_NORM, Change.BFLOAT16
    }  # fmt: skip
    loaded = load_config(SEED)
    log = case("aten.log.default", "loss")
    assert plan("log-of-softmax", Fix(patch=True), log, loaded).reach is Reach.LOCAL
    assert plan("log-of-zero", Fix(guard=True), log, loaded).reach is Reach.LOCAL
    clip = plan("exploding-gradients", Fix(Change.CLIP_GRAD_NORM), log, loaded)
    assert clip.reach is Reach.HISTORY and not clip.from_start


def test_the_terminal_says_where_and_why_before_it_replays_the_fixes(lr_jump):
    """On a pipe: the located panel, then a plain line per replay, then the report's panel
    with the verdicts (the order of the text, not its timing)."""
    result = CliRunner().invoke(app, ["diagnose", str(lr_jump)])
    assert result.exit_code == 1, result.output
    out = result.output
    early = out.index("· verifying the fixes")
    why = out.index("Why, best first", early)
    replay = re.search(r"^verifying learning-rate-too-high: with a 10x smaller", out, re.M)
    assert replay is not None, out
    final = out.index("NON-FINITE at step", replay.start())
    assert early < why < replay.start() < final
    assert re.search(r"✔ verified|✘ not enough", out[final:])  # the verdicts, last
    assert not re.search(r"✔ verified|✘ not enough", out[:final])
    assert "(resumed from a snapshot)" in out[replay.start() : final]


def test_quiet_lines_and_a_report_on_stdout_stay_clean(lr_jump):
    """`-q` prints its few lines only; `--json -` leaves stdout to the report (the panel
    and the replay lines go to stderr)."""
    result = CliRunner().invoke(app, ["diagnose", str(lr_jump), "-q"])
    assert result.exit_code == 1, result.output
    assert "verifying" not in result.output
    assert result.output.startswith("nandoctor diagnose")
    result = CliRunner().invoke(app, ["diagnose", str(lr_jump), "--json", "-"])
    assert result.exit_code == 1, result.output
    assert json.loads(result.stdout)["status"] == "nonfinite"
    assert "verifying learning-rate-too-high" in result.stderr
