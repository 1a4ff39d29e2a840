"""What this machine costs: measured step times that the budget chooser prices trees by, and `treeserve profile`.

- cost_curve.py: `CostCurve`, the file format of a measured T(n nodes, batch) beside its bounds (torch-free);
- cost_measure.py: measuring such a curve for a model on a device, beside the weight-streaming and FLOP bounds;
- profile_model.py: the model measured: a directory, or a preset's config facts (deploy/models) with random
  weights built on the device, whole or as one tensor-parallel rank;
- profile.py: `HardwareProfile`, the batch-1 cost curves the chooser learns at start-up, cached per machine.
"""
