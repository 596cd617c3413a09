"""The benchmark harness behind `metrale bench` (DESIGN §1, layer 7): throughput, latency,
memory and roofline fraction per batch size, with JSON, a table and an optional plot."""
from .env import environment
from .harness import BenchConfig, BenchInterrupted, run_bench
from .report import RESULT_KEYS, TOP_KEYS, check_schema, format_table, write_json

__all__ = ["BenchConfig", "BenchInterrupted", "run_bench", "environment", "format_table",
           "write_json", "check_schema", "TOP_KEYS", "RESULT_KEYS"]
