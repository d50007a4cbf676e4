"""The data layer: what the drivers (gateway, operator, simulator) know about workers from the
workers themselves. One scrape loop with one adapter per engine (metrics, and llama.cpp's
slots), engine metrics parsing, and the vLLM KV-cache event hub.

Below the drivers and above the routing core: it writes into the core's pools and never
imports a driver, so the gateway and the operator are siblings that both use it.
"""
