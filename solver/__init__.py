"""Scheduler for prima-rpc: device/model profiles, the cost model, Halda, baselines, makespans and a TPOT simulator.

Entry points: `solver.halda.halda(Instance(...))`, `solver.strategies.plan_offline(...)`,
`solver.simulator.simulate(plan, instance)`, `solver.pipeline.makespan(...)`.
"""
