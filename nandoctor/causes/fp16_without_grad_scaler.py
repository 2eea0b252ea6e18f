"""fp16-without-grad-scaler: float16 autocast training whose backward no GradScaler scales.

Only `nandoctor lint` looks for it (in the source, where the plain `loss.backward()` and the
missing scaler show): a replay builds the scaler from the config (`precision.grad_scaler`,
on by default for float16), so what it sees is the overflow or the underflow that follows,
named by fp16-overflow or exploding-gradients. No rule and no fix to replay.
"""

from __future__ import annotations

from nandoctor.causes.unit import CauseUnit, entry

ID = "fp16-without-grad-scaler"

INFO = entry(
    ID,
    title="float16 autocast training without a GradScaler",
    explanation="""
    Under float16 autocast the backward of every op that ran in float16 runs in float16
    too, and without loss scaling its small gradients fall below what float16 holds: under
    6.1e-5 (the smallest normal) they lose precision, under ~6.0e-8 (the smallest
    subnormal) they flush to 0 and those weights stop learning. A backward value above
    65504 becomes inf, and with no scaler to skip that step `opt.step()` applies it: SGD
    makes the weights inf, Adam divides inf by inf and makes them NaN, and every loss after
    is NaN. A GradScaler multiplies the loss by 65536 (then adapts it), so the gradients sit
    inside float16's range, divides them back in float32 before the step, and skips a step
    whose gradients overflowed; bfloat16 has float32's exponent range (to ~3.4e38) and
    needs no scaler.
    """,
    fix="""
    Create `scaler = torch.amp.GradScaler("cuda")` once and train with
    `scaler.scale(loss).backward()`, `scaler.step(opt)` and `scaler.update()`: small
    gradients stay in float16's range and an overflowed step is skipped instead of applied.
    Or autocast to `torch.bfloat16` (Ampere and newer GPUs), which needs no scaler.
    """,
    before="""
    with torch.autocast("cuda", dtype=torch.float16):
        loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    """,
    after="""
    scaler = torch.amp.GradScaler("cuda")  # once, before the loop
    with torch.autocast("cuda", dtype=torch.float16):
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    """,
)


CAUSE = CauseUnit(INFO)
