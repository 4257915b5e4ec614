"""The memory tier (node-local shared-memory snapshots with a replica on another node): its face and clean-up
(tier.py), the node folder and group (node.py), when to snapshot (schedule.py), the file format (raw.py), the
snapshot (write.py), the replicas (replicate.py) and the resume's read (read.py)."""
