"""`sluice kafka`: Kafka in, Kafka out (:mod:`sluice.kafka.bridge`)."""
