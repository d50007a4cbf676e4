"""A continuous-batching LLM engine model: one model, two clocks (real time in the simulated
worker server, virtual time in the simulator)."""
