"""`/metrics`: the Prometheus expositions of every engine replica merged into one, family by family.

Each replica labels its samples with `replica`, so merging is concatenating samples per family; the
result is rendered by prometheus-client, which keeps one HELP/TYPE header per family."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Metric, generate_latest
from prometheus_client.parser import text_string_to_metric_families


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def merge_expositions(texts: Iterable[str | bytes]) -> bytes:
    families: dict[str, Metric] = {}
    for text in texts:
        if isinstance(text, bytes):
            text = text.decode()
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                families[family.name] = family
            else:
                merged.samples.extend(family.samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)
