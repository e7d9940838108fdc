import glob,time,torch
from transformers import AutoModelForCausalLM
p=glob.glob('/root/.cache/memsifter/models/smollm2-135m-instruct-*')[0]
res={}
for impl in ['sdpa','eager']:
  m=AutoModelForCausalLM.from_pretrained(p,torch_dtype=torch.bfloat16,attn_implementation=impl).cuda()
  B,L=19,1700
  ids=torch.randint(0,49000,(B,L),device='cuda');am=torch.ones(B,L,dtype=torch.long,device='cuda');am[:,:300]=0
  pos=(am.cumsum(-1)-1).clamp(min=0)
  def fw(grad):
    with torch.set_grad_enabled(grad):
      lg=m(input_ids=ids,attention_mask=am,position_ids=pos,use_cache=False).logits[:,-65:-1].float()
      lp=torch.log_softmax(lg,-1).gather(-1,ids[:,-64:,None]).sum()
      if grad: lp.backward()
  for g in ([False,True] if impl=='sdpa' else [False]):
    fw(g);torch.cuda.synchronize();t=time.time()
    for _ in range(3): fw(g)
    torch.cuda.synchronize();res[(impl,g)]=(time.time()-t)/3
  del m;torch.cuda.empty_cache()
for k,v in res.items(): print(k,'%.3f s per 32k-token micro-batch (x7 per step ~ %.1f s)'%(v,7*v))
from torch.profiler import profile,ProfilerActivity
m=AutoModelForCausalLM.from_pretrained(p,torch_dtype=torch.bfloat16,attn_implementation='sdpa').cuda()
with profile(activities=[ProfilerActivity.CUDA,ProfilerActivity.CPU]) as pr: fw(True);torch.cuda.synchronize()
print(pr.key_averages().table(sort_by='cuda_time_total',row_limit=12,max_name_column_width=40))
