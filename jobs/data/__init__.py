"""The worker's data: records to labelled token ids (examples), fixed-length sequences (packing), the resumable
batch stream and eval batches (stream), the data sources (sources), the weighted mixture (mixture) and the
packed-table cache (cache)."""

from .examples import IGNORE, DataError, Example, examples_from_records, read_examples
from .packing import (
    MicroBatch,
    PackingMode,
    SequenceTable,
    StepBatch,
    best_fit_rows,
    build_sequences,
    count_tokens,
    micro_batch,
    packing_mode,
    row_tokens,
)
from .stream import BatchStream, EvalSplit, eval_batches, split_eval

__all__ = [
    "IGNORE", "BatchStream", "DataError", "EvalSplit", "Example", "MicroBatch", "PackingMode", "SequenceTable",
    "StepBatch", "best_fit_rows", "build_sequences", "count_tokens", "eval_batches", "examples_from_records",
    "micro_batch", "packing_mode", "read_examples", "row_tokens", "split_eval",
]
