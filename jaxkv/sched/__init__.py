"""The pure scheduler (no jax): ``schedule(state) -> (state, plan)`` and ``update``, its step-cost
model, and a dry run of the scheduler alone that lists the step shapes a workload compiles."""
