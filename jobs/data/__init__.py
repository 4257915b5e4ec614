"""The worker's data: records to labelled token ids and packed sequences (packing), the data sources
(sources), the weighted mixture (mixture) and the packed-table cache (cache)."""

from .packing import (
                      IGNORE,
                      BatchStream,
                      DataError,
                      EvalSplit,
                      Example,
                      MicroBatch,
                      PackingMode,
                      SequenceTable,
                      StepBatch,
                      best_fit_rows,
                      build_sequences,
                      count_tokens,
                      eval_batches,
                      examples_from_records,
                      micro_batch,
                      packing_mode,
                      read_examples,
                      row_tokens,
                      split_eval,
)

__all__ = [
    "IGNORE", "BatchStream", "DataError", "EvalSplit", "Example", "MicroBatch", "SequenceTable", "StepBatch",
    "PackingMode", "best_fit_rows", "micro_batch", "packing_mode", "build_sequences", "count_tokens", "eval_batches", "examples_from_records", "read_examples", "row_tokens",
    "split_eval",
]
