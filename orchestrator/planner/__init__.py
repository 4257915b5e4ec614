"""Planning, login-node side and pure: load a spec and resolve it against its profile once, read the
model's shape, model memory and time, and format the plan. Never runs a command or touches submitit."""
