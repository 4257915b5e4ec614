"""The in-allocation supervisor (runs beside the workers, never imports torch): see run.py."""
