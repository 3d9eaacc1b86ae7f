"""host_step with the model's forward replaced by fixed logits (a GPU host's view: the model's work is elsewhere)."""
import sys, tempfile, torch, statistics
from pathlib import Path
from loadtest import host_step as hs
from workers.engine import Engine
from workers.model_loader import default_model_path
from workers.output_processor import OutputKind
tmp=tempfile.mkdtemp()
model=hs.write_model(Path(tmp), default_model_path(), 512)
L=128+48+64
e=Engine(model=model,dtype='float32',device='cpu',num_threads=2,max_num_seqs=256,max_num_batched_tokens=2048,
 max_model_len=L,block_size=16,num_kv_blocks=256*-(-L//16)+16,num_speculative_tokens=0,async_scheduling=True)
prompts=hs._prompts(256,128,e.vocab_size)
K=OutputKind("final")
hs.measure(e,prompts[:8],4,K)
cls=type(e.runner); real=cls._forward
fixed=torch.randn(256,512)
def fake(self,ids,pos,meta,li):
    if ids.shape[0]==256 and li.shape[0]==256: return fixed
    return real(self,ids,pos,meta,li)
cls._forward=fake
res=[]
for _ in range(5):
    r=hs.measure(e,prompts,48,K); res.append(r['ms_per_step'])
med={k: round(statistics.median(x[k] for x in res),3) for k in res[0]}
print(sys.argv[1], med)
