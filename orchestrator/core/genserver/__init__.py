"""grpo's generation servers as the trainers and the supervisor talk to them, torch-free: the deadline-bound client
and weight publishing (client.py), the command lines (servecmd.py), and vLLM's protocol (vllm.py)."""
