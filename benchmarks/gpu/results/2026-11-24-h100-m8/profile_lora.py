import glob,time,torch
from transformers import AutoModelForCausalLM
from peft import LoraConfig,get_peft_model
p=glob.glob('/root/.cache/memsifter/models/smollm2-135m-instruct-*')[0]
m=AutoModelForCausalLM.from_pretrained(p,dtype=torch.bfloat16,attn_implementation='sdpa').cuda()
m=get_peft_model(m,LoraConfig(r=16,lora_alpha=32,target_modules='all-linear'))
B,L=19,1700
ids=torch.randint(0,49000,(B,L),device='cuda');am=torch.ones(B,L,dtype=torch.long,device='cuda');am[:,:300]=0
pos=(am.cumsum(-1)-1).clamp(min=0)
def fw(grad,lens=None):
  with torch.set_grad_enabled(grad):
    lg=m(input_ids=ids,attention_mask=am,position_ids=pos,use_cache=False).logits[:,-65:-1].float()
    lp=torch.log_softmax(lg,-1).gather(-1,ids[:,-64:,None]).sum()
    if grad: lp.backward()
for g in [False,True]:
  fw(g);torch.cuda.synchronize();t=time.time()
  for _ in range(3): fw(g)
  torch.cuda.synchronize();print('lora r16 all-linear',g,'%.3f s per 32k-token micro-batch'%((time.time()-t)/3))
from verl.utils.torch_functional import logprobs_from_logits
import verl.utils.torch_functional as tf
lg=torch.randn(19*64,49152,device='cuda')
for n in range(19*64-40,19*64,5):
  torch.cuda.synchronize();t=time.time();logprobs_from_logits(lg[:n],ids.flatten()[:n]);torch.cuda.synchronize();print('logprobs_from_logits n=%d %.3f s'%(n,time.time()-t))
