"""The trainer of the reference model: corpus (``data``), GRAPH_MODE training loop with
checkpoints, routing trace and online EfficientMoE capacities (``trainer``), and the run
report (``report``). ``ms-efficient train`` and the measured benchmarks use it."""
