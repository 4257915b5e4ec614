"""SFT (train.method sft, the default): supervised fine-tuning on token streams, packed or not. ``data.py`` reads
and packs the data (cached per run), ``step.py`` is its optimizer step (the token-mean cross-entropy, chunked where
train.loss says so: jobs/step.py train_step), ``evaluate.py`` its evaluation. Its row is in jobs/methods.py."""
