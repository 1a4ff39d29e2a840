"""TreeServe's tools over the engine: the bench behind `treeserve bench` (bench/) and the offline training of
drafters, the C2T classifier and the self-distillation corpus (training/). They import the engine (engine/);
the engine and the services never import them, so the decoding library carries no training or measuring code."""
