"""grpo's vLLM generation server as the trainers and the supervisor talk to it, torch-free: the deadline-bound client
and weight publishing (client.py), vLLM's command line and protocol (vllm.py), and what the supervisor and the ranks
hand each other when a server is replaced (handover.py)."""
