"""Worker side of fsdpjob: runs inside the job (imports torch); the login node only pickles jobs.entry."""
