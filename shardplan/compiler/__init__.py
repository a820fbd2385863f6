"""What the compilers do, as the planner predicts it: the cost model, memory and fusion, layouts, collective
combining, HBM traffic, split-K, the TPU's bf16 pass, XLA's partitioner bugs, the pair tables; and how a
prediction is held against what was compiled (the deviceless GPU/TPU targets, HLO reading, the audit, the
compiled memory fit and the measured error bands)."""
