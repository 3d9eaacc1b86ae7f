"""Offline load-test harness: benchmark workloads, HF baselines and our engine."""
