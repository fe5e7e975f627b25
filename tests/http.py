"""HTTP from tests to a peer's or a monitor's endpoints on 127.0.0.1: /metrics scraped into samples, /healthz."""
from __future__ import annotations

import urllib.error
import urllib.request
from typing import Dict, Optional, Tuple

from prometheus_client.parser import text_string_to_metric_families


def get(port: int, path: str) -> Tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return 0, ""


def scrape(port: int) -> Dict[Tuple[str, Tuple[Tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} from a peer's /metrics."""
    status, text = get(port, "/metrics")
    if status != 200:
        return {}
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples, name: str, **labels) -> Optional[float]:
    return samples.get((name, tuple(sorted(labels.items()))))
