"""How to watch durable: activity and key reads for people, Prometheus metrics, and the doctor."""
