"""The plan JSON of an assignment a ring already holds, priced on its devices' profiles (what status, the page
and the head's live re-planner show beside the measured times)."""

from solver.cost_model import Instance, evaluate
from solver.model_profile import ModelProfile
from solver.plan import build_plan
from solver.strategies import plan_to_json


def priced(devices: tuple, manifest: dict, k: int, windows: list[int], n_ctx: int) -> dict:
    """The plan JSON of the assignment (k rounds, each device's window per round) on these profiles, with KV room
    for n_ctx positions."""
    inst = Instance(devices, ModelProfile.from_json(manifest), n_ctx=n_ctx)
    gpu, members = [0] * len(windows), [True] * len(windows)  # nodes run their layers on CPU; the walk finds members
    plan = build_plan(inst, k, windows, gpu, members, 0.0, "applied")
    return plan_to_json(plan, inst.model.n_layers, evaluate(inst, k, windows, gpu, members))
