# Environment for the GPU scripts (source it from the repository root):
#   - the package bundle (.devbundle: flashinfer, ray, nixl, mooncake), unpacked once per machine
#     into /tmp/devsite; a later call on the same warm machine may carry only
#     .devbundle/activate.sh;
#   - grpcio/protobuf new enough for the checked-in stubs (the GPU machine's grpcio 1.84 is older
#     than router_pb2_grpc.py asks for), and the router's pure-Python dependencies the machine
#     lacks (prometheus-client; the HTTP front's fastapi/uvicorn/pydantic), from
#     .devgrpc/grpc.tar.xz, unpacked once into /tmp/devgrpc. Build it with:
#       pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux2014_x86_64 grpcio==1.85.3 grpcio-health-checking==1.85.1 \
#         grpcio-reflection==1.85.1 protobuf==7.36.2 prometheus-client fastapi starlette \
#         uvicorn pydantic pydantic-core annotated-types typing-inspection typing-extensions \
#         anyio sniffio h11 click httpx httpcore certifi idna -d W
#       unzip every wheel into W/site; tar -cJf .devgrpc/grpc.tar.xz -C W/site .   # ~9 MiB
#     The whole .devbundle and .devgrpc together pass the 64 MiB carry limit: carry .devbundle
#     in one call and `.devbundle/activate.sh` + `.devgrpc` in the next.
#   - or the bundle in two parts that each fit a call next to the tree: .devbundle-fi
#     (`build_bundle.py --only flashinfer-python,apache-tvm-ffi --out .devbundle-fi`, plus
#     .devbundle's flashinfer-aot.tar.xz and stash_flashinfer.py) and .devbundle-rest (the full
#     bundle's site.tar.xz less flashinfer and tvm_ffi, repacked), unpacked into /tmp/devsite and
#     /tmp/devsite-rest by the first call that carries each.
if [ -f .devbundle/activate.sh ]; then
  source .devbundle/activate.sh
elif [ -f .devbundle-fi/activate.sh ]; then
  source .devbundle-fi/activate.sh
elif [ -f /tmp/devsite/.ok ]; then
  export PYTHONPATH=/tmp/devsite${PYTHONPATH:+:$PYTHONPATH}
fi
#   - or .devbundle-nixl: .devbundle-rest less Mooncake (~34 MiB), which fits one call next to the
#     tree and .devgrpc (a serving run over NIXL in one call); unpacked into /tmp/devsite-rest too.
for _b in .devbundle-rest .devbundle-nixl; do
  if [ -f $_b/site.tar.xz ] && [ ! -f /tmp/devsite-rest/.ok ]; then
    rm -rf /tmp/devsite-rest && mkdir -p /tmp/devsite-rest \
      && tar -xJf $_b/site.tar.xz -C /tmp/devsite-rest && touch /tmp/devsite-rest/.ok
  fi
done
if [ -f /tmp/devsite-rest/.ok ]; then
  export PYTHONPATH=/tmp/devsite-rest${PYTHONPATH:+:$PYTHONPATH}
  _cu=$(python3 -c "import nvidia, os; print(os.path.join(nvidia.__path__[0], 'cu13', 'lib'))" 2>/dev/null)
  [ -n "$_cu" ] && export LD_LIBRARY_PATH=$_cu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
fi
if [ -f .devgrpc/grpc.tar.xz ] && [ ! -f /tmp/devgrpc/.ok ]; then
  rm -rf /tmp/devgrpc && mkdir -p /tmp/devgrpc && tar -xJf .devgrpc/grpc.tar.xz -C /tmp/devgrpc \
    && touch /tmp/devgrpc/.ok
fi
if [ -f /tmp/devgrpc/.ok ]; then export PYTHONPATH=/tmp/devgrpc${PYTHONPATH:+:$PYTHONPATH}; fi
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
export RAY_AUTH_MODE=disabled NIXL_LOG_LEVEL=WARN MC_LOG_LEVEL=WARNING
