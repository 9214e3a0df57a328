"""A plan kept in a task's checkpoint, and taken back at a restart instead of profiling the model again.

Profiling runs the model several times per round of cutting, before any
bubble; a restarted task would pay it again beside the training. The plan's
measured part travels in the checkpoint instead: how the graph was made (fx
with which modules opened, or ``torch.export``), the atoms and their measured
costs. A restart makes the graph again (tracing runs no kernel) and takes the
plan back if the graph is the same node for node and the steps are to be no
shorter than planned; anything else is planned afresh, and said why.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

from torch import nn

from freeride.partition.exported import export
from freeride.partition.graph import Atom, NodeGraph, trace
from freeride.partition.plan import Plan

__all__ = ["plan_state", "reused_plan"]

logger = logging.getLogger(__name__)

_VERSION = 1
_SHORTER = 0.8
"""Steps to be shorter than this share of the planned target are planned again: the atoms are too coarse."""


def _digest(graph: NodeGraph) -> str:
    text = ";".join(f"{n.op}:{n.name}:{n.target}" for n in graph.nodes)
    return hashlib.blake2s(text.encode(), digest_size=8).hexdigest()


def plan_state(plan: Plan) -> dict[str, Any]:
    """What a checkpoint keeps of ``plan``: plain values only (a weights-only load takes them)."""
    return {
        "version": _VERSION,
        "exported": plan.exported,
        "opened": sorted(plan.opened),
        "graph": _digest(plan.graph),
        "atoms": [[a.start, a.stop, a.part, a.parts] for a in plan.atoms],
        "forward_s": list(plan.forward_s),
        "backward_s": list(plan.backward_s),
        "target_s": plan.target_s,
        "training": plan.training,
    }


def reused_plan(model: nn.Module, x: object, saved: object, *, target_s: float, training: bool) -> Plan | None:
    """The plan ``saved`` for ``model`` on the batch input ``x``, grouped for ``target_s``; None: plan afresh."""
    name = type(model).__name__
    why = _unusable(saved, target_s, training)
    if why:
        logger.info("[partition] %s: the checkpoint's plan is not reused (%s): profiling", name, why)
        return None
    assert isinstance(saved, dict)
    try:
        if saved["exported"]:
            module, build = export(model, x)
            graph = NodeGraph(module, module.graph, build)
        else:
            graph = NodeGraph(model, trace(model, set(saved["opened"])))
    except Exception as exc:  # the model changed since: fx or export fails where it did not
        logger.info("[partition] %s: the checkpoint's plan is not reused (%s): profiling", name, exc)
        return None
    atoms = [Atom(*map(int, a)) for a in saved["atoms"]]
    if _digest(graph) != saved["graph"] or not atoms or atoms[-1].stop > len(graph.nodes):
        logger.info("[partition] %s: the checkpoint's plan is of another graph: profiling", name)
        return None
    plan = Plan.of(
        graph,
        atoms,
        [float(c) for c in saved["forward_s"]],
        [float(c) for c in saved["backward_s"]],
        target_s=target_s,
        training=training,
        opened=tuple(saved["opened"]),
        exported=bool(saved["exported"]),
    )
    logger.info(
        "[partition] %s: the checkpoint's plan reused (%d atoms, %d forward and %d backward steps): no profiling",
        name,
        len(atoms),
        len(plan.forward),
        len(plan.backward),
    )
    return plan


def _unusable(saved: object, target_s: float, training: bool) -> str:
    """Why ``saved`` cannot be taken back ("" where it can)."""
    if not isinstance(saved, dict) or saved.get("version") != _VERSION:
        return "none kept, or of another version"
    if bool(saved.get("training")) != training:
        return "made for inference" if training else "made for training"
    if target_s < _SHORTER * float(saved.get("target_s", 0.0)):
        return f"steps of {target_s * 1e3:.1f} ms wanted, planned for {float(saved['target_s']) * 1e3:.1f} ms"
    atoms, fwd, bwd = saved.get("atoms"), saved.get("forward_s"), saved.get("backward_s")
    if not (isinstance(atoms, list) and isinstance(fwd, list) and isinstance(bwd, list)):
        return "incomplete"
    if not len(atoms) == len(fwd) == len(bwd):
        return "incomplete"
    return ""
