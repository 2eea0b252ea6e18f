"""Every check as a unit: its registry entry, its own VALID/INVALID snippets, the brief.

The snippets are the ones docs/lint.md shows, so an example in the docs cannot lie.
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import nandoctor.lint.checks
from nandoctor.causes import catalog
from nandoctor.lint import Severity, lint_text
from nandoctor.lint.registry import CHECKS, all_checks, table
from nandoctor.lint.unit import Check

CHECK_IDS = list(all_checks())
SNIPPETS = [
    pytest.param(c.id, kind, i, snippet, id=f"{c.id}-{kind}-{i}")
    for c in all_checks().values()
    for kind, snippets in (("invalid", c.invalid), ("valid", c.valid))
    for i, snippet in enumerate(snippets)
]

# The brief's failing loop and its fix, verbatim (the fix adds the import it relies on).
BRIEF_LOOP = """\
import torch
model = Net().cuda()
opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
scaler = torch.cuda.amp.GradScaler()
for epoch in range(10):
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(x)
            loss = -(y * torch.log(torch.softmax(logits, -1))).sum(-1).mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
"""
BRIEF_FIXED = (
    BRIEF_LOOP.replace("import torch\n", "import torch\nimport torch.nn.functional as F\n")
    .replace(
        "loss = -(y * torch.log(torch.softmax(logits, -1))).sum(-1).mean()",
        "loss = F.cross_entropy(logits, y)",
    )
    .replace(
        "        scaler.step(opt)\n",
        "        scaler.unscale_(opt); torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
        "        scaler.step(opt)\n",
    )
)


def ids(text: str) -> list[tuple[int, str]]:
    outcome = lint_text(text)
    assert not outcome.skipped
    return [(f.line, f.id) for f in outcome.findings]


def test_the_brief_loop_shows_its_two_lint_visible_mistakes():
    assert ids(BRIEF_LOOP) == [(9, "log-of-softmax"), (12, "exploding-gradients")]


def test_the_brief_loop_fixed_is_clean():
    assert "F.cross_entropy" in BRIEF_FIXED and "unscale_" in BRIEF_FIXED
    assert ids(BRIEF_FIXED) == []


def test_the_brief_loop_severities():
    findings = {f.id: f for f in lint_text(BRIEF_LOOP).findings}
    assert findings["log-of-softmax"].severity is Severity.ERROR
    assert findings["exploding-gradients"].severity is Severity.WARNING


def test_the_brief_loop_with_a_clip_before_unscale():
    clip = "        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
    clipped = BRIEF_LOOP.replace("        scaler.step(opt)\n", clip + "        scaler.step(opt)\n")
    assert ids(clipped) == [(9, "log-of-softmax"), (12, "clip-before-unscale")]


@pytest.mark.parametrize(("check_id", "kind", "index", "snippet"), SNIPPETS)
def test_snippets(check_id, kind, index, snippet):
    found = [i for _, i in ids(snippet)]
    if kind == "invalid":
        assert check_id in found, f"INVALID example {index} of {check_id} was not flagged"
    else:
        assert check_id not in found, f"VALID example {index} of {check_id} was flagged"


@pytest.mark.parametrize("check_id", CHECK_IDS)
def test_each_check_is_a_documented_unit(check_id):
    unit = all_checks()[check_id]
    assert unit.cause is catalog.get(check_id)
    assert unit.summary.endswith(".")
    assert unit.invalid and unit.valid
    assert unit.run.__module__ == f"nandoctor.lint.checks.{check_id.replace('-', '_')}"
    assert unit.heuristic == (unit.severity is Severity.INFO)


def test_the_table_refuses_duplicates_and_unknown_ids():
    first = all_checks()["log-of-softmax"]
    with pytest.raises(ValueError, match=r"twice: first by CHECKS\[0\].*again by CHECKS\[1\]"):
        table([first, first])
    unknown = Check(
        id="no-such-cause",
        severity=Severity.ERROR,
        summary=".",
        run=first.run,
        invalid=(),
        valid=(),
    )
    with pytest.raises(KeyError):
        table([unknown])
    assert "no-such-cause" not in all_checks()


def test_every_check_module_is_in_the_table_once():
    """Nothing registers by being imported: a module whose CHECK is left out of
    `lint.registry.CHECKS` would never run, so the test reads the package itself."""
    modules = {
        info.name: importlib.import_module(f"nandoctor.lint.checks.{info.name}")
        for info in pkgutil.iter_modules(nandoctor.lint.checks.__path__)
    }
    assert sorted(modules) == sorted(c.id.replace("-", "_") for c in CHECKS)
    for name, module in modules.items():
        assert module.CHECK in CHECKS, f"{name}.CHECK is missing from lint.registry.CHECKS"
    assert list(all_checks()) == [c.id for c in CHECKS]


def test_the_table_puts_heuristics_last():
    severities = [c.severity.rank for c in all_checks().values()]
    assert severities == sorted(severities, reverse=True), "errors first, then warnings"
    assert severities[-2:] == [Severity.INFO.rank, Severity.INFO.rank]
    assert CHECK_IDS[:3] == ["log-of-softmax", "log-of-zero", "clip-before-unscale"]


def test_findings_point_at_the_offending_call():
    (finding,) = lint_text("import torch\ny = 1 + torch.log(x.softmax(-1))\n").findings
    assert (finding.line, finding.column, finding.end_column) == (2, 9, 33)  # end: exclusive
    assert finding.code == "y = 1 + torch.log(x.softmax(-1))"


def test_a_message_gives_remedy_and_reason():
    (finding,) = lint_text("import torch\np = torch.softmax(z, -1)\ny = torch.log(p)\n").findings
    assert finding.message.startswith("Use `F.log_softmax`")
    assert "from line 2" in finding.message
    assert "-inf" in finding.message


def test_a_hand_written_binary_cross_entropy_of_an_nn_sigmoid_module():
    text = (
        "import torch\nfrom torch import nn\nclass Head(nn.Module):\n"
        "    def __init__(self):\n        self.act = nn.Sigmoid()\n"
        "    def forward(self, z, y):\n        p = self.act(z)\n"
        "        return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()\n"
    )
    assert ids(text) == [(8, "log-of-softmax"), (8, "log-of-zero")]


TWO_LOOPS = """\
import torch
scaler = torch.amp.GradScaler()
for x, y in warmup_loader:
    scaler.scale(model(x, y)).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
for x, y in loader:
    scaler.scale(model(x, y)).backward()
    scaler.step(opt)
    scaler.update()
"""


def test_missing_clipping_is_judged_per_loop():
    assert ids(TWO_LOOPS) == [(11, "exploding-gradients")]


def test_a_loop_that_clips_through_a_helper_of_the_file_is_clipped():
    helper = "def clip_and_step():\n    torch.nn.utils.clip_grad_norm_(params, 1.0)\n"
    text = TWO_LOOPS.replace("    scaler.step(opt)\n    scaler.update()\n", "", 1)
    text = helper + text.replace(
        "    scaler.scale(model(x, y)).backward()\n    scaler.step",
        "    scaler.scale(model(x, y)).backward()\n    clip_and_step()\n    scaler.step",
    )
    assert "exploding-gradients" not in {i for _, i in ids(text)}


def test_a_clip_imported_under_another_name_clips():
    text = "from torch.nn.utils import clip_grad_norm_ as cgn\n" + TWO_LOOPS.replace(
        "    scaler.scale(model(x, y)).backward()\n    scaler.step",
        "    scaler.scale(model(x, y)).backward()\n    scaler.unscale_(opt)\n"
        "    cgn(model.parameters(), 1.0)\n    scaler.step",
    )
    assert ids(text) == []
    renamed = text.replace("cgn", "bound")
    assert ids(renamed) == [], "the name it was imported under, not its spelling here"


def test_a_gradient_hook_bounds_every_loop():
    text = (
        TWO_LOOPS + "for p in model.parameters():\n    p.register_hook(lambda g: g.clamp(-1, 1))\n"
    )
    assert ids(text) == []
