# vllm-router, the router in front of lily's replicas (see compose.yaml).
FROM python:3.12-slim
RUN pip install --no-cache-dir vllm-router==0.1.17
ENTRYPOINT ["vllm-router"]
