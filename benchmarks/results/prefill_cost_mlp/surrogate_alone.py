import time, torch
from lukv_cache.profiles import Profile
torch.set_num_threads(2)
m = Profile.load('profiles_hub/HuggingFaceTB/SmolLM2-135M-Instruct/kvzap.safetensors').surrogate
l = Profile.load('tests/data/kvzap_smollm2_linear_window.safetensors').surrogate
x = torch.randn(1, 4096, 387)
for name, s in (("mlp", m), ("linear", l)):
    for _ in range(3): s.predict(3, x)
    t = time.perf_counter()
    for i in range(30): s.predict(i, x)
    print(name, (time.perf_counter() - t), "s for 30 layers")
