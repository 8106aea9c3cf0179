{{/* Names and labels shared by every template. */}}

{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else if contains (include "tandem.name" .) .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "tandem.name" .) | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Labels on every object; pass (dict "ctx" $ "component" "gateway"). */}}
{{- define "tandem.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: tandem
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
{{ include "tandem.selectorLabels" . }}
{{- end -}}

{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* image reference; pass (dict "ctx" $ "image" .Values.images.gateway). A digest (the release
workflow's, sha256:...) takes precedence over the tag: repository@digest. */}}
{{- define "tandem.image" -}}
{{- if .image.digest -}}
{{- printf "%s@%s" .image.repository .image.digest -}}
{{- else -}}
{{- printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag) -}}
{{- end -}}
{{- end -}}

{{- define "tandem.tdName" -}}
{{- default (include "tandem.fullname" .) .Values.tandemDeployment.name -}}
{{- end -}}

{{- define "tandem.redisSecretName" -}}
{{- if .Values.redis.existingSecret -}}
{{- .Values.redis.existingSecret -}}
{{- else -}}
{{- printf "%s-redis" (include "tandem.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/*
The key of the Redis Secret that holds a component's Redis URL; pass (dict "ctx" $ "component" "gateway").
With redis.auth.enabled each component logs in as its own ACL user: "<component>-url" (gateway, router,
worker; admin-url is for tandem-admin and mounted nowhere). Without: every one reads the same URL.
*/}}
{{- define "tandem.redisSecretKey" -}}
{{- if .ctx.Values.redis.auth.enabled -}}
{{- printf "%s-url" .component -}}
{{- else if .ctx.Values.redis.existingSecret -}}
{{- .ctx.Values.redis.existingSecretKey -}}
{{- else -}}url{{- end -}}
{{- end -}}

{{/* The Redis env of a component; pass (dict "ctx" $ "prefix" "TANDEM_GATEWAY_" "component" "gateway"). */}}
{{- define "tandem.redisEnv" -}}
- name: {{ .prefix }}REDIS__URL
  valueFrom:
    secretKeyRef:
      name: {{ include "tandem.redisSecretName" .ctx }}
      key: {{ include "tandem.redisSecretKey" . }}
- name: {{ .prefix }}REGISTRY__KEY_PREFIX
  value: {{ .ctx.Values.redis.keyPrefix | quote }}
{{- end -}}

{{/*
The Redis ACL file: Redis's default user behind a password no pod is given, and one user per component
with the rules of tandem.common.redis_acl (the one source of truth; tests/chart/test_redis_acl.py checks that
these lines are the ones it writes). Passwords only as their SHA-256. Pass (dict "ctx" $ "passwords" (dict
"default" ... "gateway" ...)).

Not `user default off`: Redis replays its append-only file as the default user and re-checks each MULTI/EXEC
against that user's rights, so with the default user off every transaction in the AOF is dropped on restart
(redis/redis#14541, fixed after 7.2; tests/faults/test_redis_durability.py lost every tenant and key so).
*/}}
{{- define "tandem.redisAclFile" -}}
{{- $p := .ctx.Values.redis.keyPrefix -}}
user default on #{{ sha256sum (index .passwords "default") }} ~* &* +@all
user {{ $p }}-gateway on #{{ sha256sum (index .passwords "gateway") }} resetchannels +ping +select +evalsha +script|load +zrange +mget +get +set +del +exists +expire +pexpire +time +ttl +hget +hgetall +hmget +hset +hdel +hincrby +sadd +srem +smembers +scard +zadd +zrem +zcard +zcount +zrangebyscore +zremrangebyscore +zremrangebyrank +lrange +rpush +ltrim +lpop +llen +lindex +rpop +multi +exec +discard %R~{{ $p }}:gw:key:* %R~{{ $p }}:gw:tenant:* ~{{ $p }}:gw:quota:* ~{{ $p }}:gw:usage:* ~{{ $p }}:gw:conv:* ~{{ $p }}:gw:stored:* ~{{ $p }}:gw:bg:* %R~{{ $p }}:worker:* %R~{{ $p }}:workers %R~{{ $p }}:workers:removed (~{{ $p }}:workers +zrem) (~{{ $p }}:adapters ~{{ $p }}:adapters:version +hgetall +hset +hdel +incrby)
user {{ $p }}-router on #{{ sha256sum (index .passwords "router") }} resetchannels +ping +select +zrange +mget +get +set +del +zadd +zrem +publish +subscribe +unsubscribe ~{{ $p }}:router:* &{{ $p }}:router:ledger %R~{{ $p }}:worker:* %R~{{ $p }}:workers %R~{{ $p }}:workers:removed (~{{ $p }}:workers +zrem)
user {{ $p }}-worker on #{{ sha256sum (index .passwords "worker") }} resetchannels +ping +select +zrange +mget +get +set +del +zadd +zrem +incrby +multi +exec +discard +hgetall ~{{ $p }}:worker:* ~{{ $p }}:workers ~{{ $p }}:workers:removed %R~{{ $p }}:adapters
user {{ $p }}-admin on #{{ sha256sum (index .passwords "admin") }} resetchannels +ping +select +evalsha +script|load +get +set +mget +del +scan +time +sadd +srem +smembers +hget +hgetall +hdel +hincrby +zcard +zrem +zrangebyscore +watch +unwatch +multi +exec +discard ~{{ $p }}:gw:* (~{{ $p }}:adapters ~{{ $p }}:adapters:version +hgetall +hset +hdel +incrby)
user {{ $p }}-operator on #{{ sha256sum (index .passwords "operator") }} resetchannels +ping +select +hgetall +hset +hdel +incrby ~{{ $p }}:adapters ~{{ $p }}:adapters:version
user {{ $p }}-raygcs on #{{ sha256sum (index .passwords "raygcs") }} resetchannels +ping +select +info +hset +hsetnx +hget +hmget +hkeys +hexists +hdel +hscan +del +exists +incrby +scan ~RAY{{ $p }}-raygcs@* (~DUMMY +del)
{{- end -}}

{{- define "tandem.routerAddress" -}}
{{- printf "%s-router:%d" (include "tandem.fullname" .) (int (include "tandem.routerPort" .)) -}}
{{- end -}}

{{/* The router port the gateway dials: the TLS front's with internalTLS, else Serve's proxy's. */}}
{{- define "tandem.routerPort" -}}
{{- if .Values.internalTLS.enabled }}{{ .Values.router.tlsPort }}{{ else }}{{ .Values.router.grpcPort }}{{ end -}}
{{- end -}}

{{/* The model volume; the init container variant fills an emptyDir. */}}
{{- define "tandem.modelVolume" -}}
- name: model
{{- if eq .Values.model.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.pvc.claimName }}
    readOnly: true
{{- else }}
  emptyDir: {}
{{- end }}
{{- end -}}

{{- define "tandem.modelMount" -}}
- name: model
  mountPath: /models
  readOnly: true
{{- if and (eq .Values.model.source "pvc") .Values.model.pvc.subPath }}
  subPath: {{ .Values.model.pvc.subPath }}
{{- end }}
{{- end -}}

{{/* The gateway's served models (TANDEM_GATEWAY_MODELS, tandem.gateway.settings.ServedModel) in the
models form: each model's name, folder, context length, tool chat template and, where given, the format of
its tool calls (unset: the gateway's default for the template). */}}
{{- define "tandem.gatewayModels" -}}
{{- $out := list -}}
{{- range $i, $m := .Values.tandemDeployment.models -}}
{{- $served := dict "name" $m.name "model_dir" $m.path "max_model_len" ($m.maxModelLen | default $.Values.model.maxModelLen | int) "tool_chat_template" (include "tandem.toolChatTemplate" (dict "model" $m "index" $i)) -}}
{{- with $m.toolCallParser }}{{ $_ := set $served "tool_call_parser" . }}{{ end -}}
{{- $out = append $out $served -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/* A model's tool chat template as the gateway reads it (ServedModel.tool_chat_template, and
TANDEM_GATEWAY_TOOL_CHAT_TEMPLATE in the single-model form): a name of a template Tandem ships ("default":
the SmolLM2 family's; "qwen2.5"; "llama3.1-json"), "" (tool_choice "auto" refused), a path in the gateway
container, or a ConfigMap's key at its mount (tandem.toolTemplateMounts, models form only). .model has name,
path and toolChatTemplate. Unset: the template of the model's family, told from its name and path (the one
mapping of family to template; tandem.gateway.settings.NAMED_TOOL_TEMPLATES maps each name to its file and
tool-call format): SmolLM2 -> "default", Llama 3.1 -> "llama3.1-json", Qwen2.5 (not its Math, VL or Coder
models, whose tool formats differ) -> "qwen2.5", any other family "": a template of the wrong family gives
prompts the model was not trained on, where a 400 says what is missing. */}}
{{- define "tandem.toolChatTemplate" -}}
{{- $t := .model.toolChatTemplate -}}
{{- $names := printf "%s %s" (.model.name | default "") (.model.path | default "") -}}
{{- if kindIs "map" $t -}}
{{- printf "/etc/tandem/tool-templates/%d/%s" .index $t.key -}}
{{- else if kindIs "string" $t -}}
{{- $t -}}
{{- else if regexMatch "(?i)smollm2" $names -}}
default
{{- else if regexMatch "(?i)llama[-_ ]?3\\.1([^0-9]|$)" $names -}}
llama3.1-json
{{- else if and (regexMatch "(?i)qwen2\\.5" $names) (not (regexMatch "(?i)qwen2\\.5-(math|vl|coder)" $names)) -}}
qwen2.5
{{- end -}}
{{- end -}}

{{/* The gateway's mounts and volumes of the ConfigMaps that hold models' tool chat templates
(models[].toolChatTemplate: {configMap, key}); .part is "mounts" or "volumes". */}}
{{- define "tandem.toolTemplateMounts" -}}
{{- range $i, $m := .ctx.Values.tandemDeployment.models -}}
{{- if kindIs "map" $m.toolChatTemplate }}
{{- if eq $.part "mounts" }}
- {name: tool-template-{{ $i }}, mountPath: /etc/tandem/tool-templates/{{ $i }}, readOnly: true}
{{- else }}
- name: tool-template-{{ $i }}
  configMap:
    name: {{ $m.toolChatTemplate.configMap | quote }}
    items:
      - {key: {{ $m.toolChatTemplate.key | quote }}, path: {{ $m.toolChatTemplate.key | quote }}}
{{- end }}
{{- end }}
{{- end -}}
{{- end -}}

{{- define "tandem.checks" -}}
{{- if and (not .Values.redis.enabled) (not .Values.redis.externalUrl) (not .Values.redis.existingSecret) -}}
{{- fail "redis: set redis.enabled, redis.externalUrl or redis.existingSecret" -}}
{{- end -}}
{{- if and (eq .Values.model.source "pvc") (not .Values.model.pvc.claimName) -}}
{{- fail "model.source is pvc: set model.pvc.claimName" -}}
{{- end -}}
{{- if and (eq .Values.model.source "initContainer") (or (not .Values.model.initContainer.image) (not .Values.model.initContainer.command)) -}}
{{- fail "model.source is initContainer: set model.initContainer.image and .command" -}}
{{- end -}}
{{- $td := .Values.tandemDeployment -}}
{{- if not $td.models -}}
{{- range $role := list "prefill" "decode" -}}
{{- include "tandem.checkPool" (dict "ctx" $ "where" (printf "tandemDeployment.pools.%s" $role) "pool" (get $td.pools $role) "revision" $.Values.model.revision) -}}
{{- end -}}
{{- include "tandem.checkPairing" (dict "where" "tandemDeployment.pools" "prefill" $td.pools.prefill "decode" $td.pools.decode "name" $.Values.model.servedModelName "revision" $.Values.model.revision) -}}
{{- end -}}
{{- /* The models form: what the operator would refuse (SpecValid=False) fails the install instead. */ -}}
{{- $served := dict -}}
{{- range $i, $m := $td.models -}}
{{- if hasKey $served $m.name -}}
{{- fail (printf "tandemDeployment.models[%d]: the name %q is taken by an earlier model" $i $m.name) -}}
{{- end -}}
{{- $_ := set $served $m.name (int (($m.lora | default dict).maxAdapters | default 0)) -}}
{{- range $role := list "prefill" "decode" -}}
{{- include "tandem.checkPool" (dict "ctx" $ "where" (printf "tandemDeployment.models[%d].%s" $i $role) "pool" (get $m $role | default dict) "revision" $m.revision) -}}
{{- end -}}
{{- include "tandem.checkPairing" (dict "where" (printf "tandemDeployment.models[%d] (%s)" $i $m.name) "prefill" $m.prefill "decode" $m.decode "name" $m.name "revision" $m.revision) -}}
{{- end -}}
{{- $adapters := dict -}}
{{- range $i, $a := $td.adapters -}}
{{- $where := printf "tandemDeployment.adapters[%d] (%s)" $i $a.name -}}
{{- if hasKey $adapters $a.name -}}
{{- fail (printf "%s: the name is taken by an earlier adapter" $where) -}}
{{- end -}}
{{- $_ := set $adapters $a.name true -}}
{{- if hasKey $served $a.name -}}
{{- fail (printf "%s: the name is a served model's" $where) -}}
{{- end -}}
{{- if not (hasKey $served $a.baseModel) -}}
{{- fail (printf "%s: baseModel %q is not a model of tandemDeployment.models (adapters need the models form, with lora.maxAdapters > 0)" $where $a.baseModel) -}}
{{- end -}}
{{- if lt (get $served $a.baseModel) 1 -}}
{{- fail (printf "%s: model %q has LoRA off (set its lora.maxAdapters > 0)" $where $a.baseModel) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* A pool's GPUs against the accelerator and its tensor-parallel size, its rollout bounds, and a revision
given twice (the operator checks all but the accelerator too):
(dict "ctx" $ "where" "tandemDeployment.pools.prefill" "pool" $pool "revision" $model.revision). */}}
{{- define "tandem.checkPool" -}}
{{- /* Absent counts are the CRD's defaults (1, 1, 4); 0 is a count, not an absence. */ -}}
{{- $replicas := ternary (int .pool.replicas) 1 (hasKey .pool "replicas") -}}
{{- $min := ternary (int .pool.minReplicas) 1 (hasKey .pool "minReplicas") -}}
{{- $max := ternary (int .pool.maxReplicas) 4 (hasKey .pool "maxReplicas") -}}
{{- if or (gt $min $replicas) (gt $replicas $max) -}}
{{- fail (printf "%s: need minReplicas <= replicas <= maxReplicas (%d <= %d <= %d)" .where $min $replicas $max) -}}
{{- end -}}
{{- $limits := (.pool.resources | default dict).limits | default dict -}}
{{- $gpus := int (get $limits "nvidia.com/gpu" | default 0) -}}
{{- $tp := int ((.pool.engineArgs | default dict).tensorParallelSize | default 1) -}}
{{- if and (eq .ctx.Values.accelerator "gpu") (lt $gpus 1) -}}
{{- fail (printf "%s: accelerator is gpu but resources.limits has no nvidia.com/gpu (the pods would run vLLM's CUDA image with no GPU)" .where) -}}
{{- end -}}
{{- if and (gt $gpus 0) (gt $tp $gpus) -}}
{{- fail (printf "%s: engineArgs.tensorParallelSize %d > the %d GPU(s) in resources.limits (one rank per GPU)" .where $tp $gpus) -}}
{{- end -}}
{{- if and .revision (hasKey ((.pool.engineArgs | default dict).extraEnv | default dict) "TANDEM_WORKER_ENGINE__MODEL_REVISION") -}}
{{- fail (printf "%s: the revision is the model's (revision); drop TANDEM_WORKER_ENGINE__MODEL_REVISION from engineArgs.extraEnv" .where) -}}
{{- end -}}
{{- $rollout := .pool.rollout | default dict -}}
{{- if and (hasKey $rollout "maxSurge") (hasKey $rollout "maxUnavailable") (eq (toString $rollout.maxSurge) "0" "0%") (eq (toString $rollout.maxUnavailable) "0" "0%") -}}
{{- fail (printf "%s: rollout.maxSurge and rollout.maxUnavailable cannot both be 0 (the rollout could never start)" .where) -}}
{{- end -}}
{{- end -}}

{{/* A model's prefill and decode pools that can never pair: what the spec declares makes their workers' KV
fingerprints differ (the operator's tandem_operator.spec.pairing_conflicts, the same rule): the dtype
(engineArgs or extraEnv, "auto" differing from nothing), the tensor-parallel size, the served model name
(extraEnv) and the revision (extraEnv's, when the model declares none):
(dict "where" "tandemDeployment.pools" "prefill" $p "decode" $d "name" $servedName "revision" $model.revision). */}}
{{- define "tandem.checkPairing" -}}
{{- $dtypes := list -}}
{{- $tps := list -}}
{{- $names := list -}}
{{- $revisions := list -}}
{{- range $pool := list .prefill .decode -}}
{{- $args := ($pool | default dict).engineArgs | default dict -}}
{{- $env := $args.extraEnv | default dict -}}
{{- $dtype := lower (trim (toString (ternary (get $env "TANDEM_WORKER_ENGINE__DTYPE") ($args.dtype | default "auto") (hasKey $env "TANDEM_WORKER_ENGINE__DTYPE")))) -}}
{{- $dtypes = append $dtypes (get (dict "half" "float16" "float" "float32") $dtype | default $dtype) -}}
{{- $tps = append $tps (trim (toString (ternary (get $env "TANDEM_WORKER_ENGINE__TENSOR_PARALLEL_SIZE") ($args.tensorParallelSize | default 1) (hasKey $env "TANDEM_WORKER_ENGINE__TENSOR_PARALLEL_SIZE")))) -}}
{{- $names = append $names (toString (ternary (get $env "TANDEM_WORKER_ENGINE__SERVED_MODEL_NAME") $.name (hasKey $env "TANDEM_WORKER_ENGINE__SERVED_MODEL_NAME"))) -}}
{{- $revisions = append $revisions (toString (get $env "TANDEM_WORKER_ENGINE__MODEL_REVISION")) -}}
{{- end -}}
{{- $differ := list -}}
{{- $p := index $dtypes 0 -}}{{- $d := index $dtypes 1 -}}
{{- if and (ne $p "auto") (ne $d "auto") (ne $p "") (ne $d "") (ne $p $d) -}}
{{- $differ = append $differ (printf "engineArgs.dtype: prefill %s, decode %s" $p $d) -}}
{{- end -}}
{{- $p = index $tps 0 -}}{{- $d = index $tps 1 -}}
{{- if and (regexMatch "^[0-9]+$" $p) (regexMatch "^[0-9]+$" $d) (ne (int $p) (int $d)) -}}
{{- $differ = append $differ (printf "engineArgs.tensorParallelSize: prefill %d, decode %d" (int $p) (int $d)) -}}
{{- end -}}
{{- $p = index $names 0 -}}{{- $d = index $names 1 -}}
{{- if ne $p $d -}}
{{- $differ = append $differ (printf "TANDEM_WORKER_ENGINE__SERVED_MODEL_NAME: prefill %s, decode %s" $p $d) -}}
{{- end -}}
{{- $p = index $revisions 0 -}}{{- $d = index $revisions 1 -}}
{{- if and (not .revision) (ne $p $d) (not (and (eq $p "") (hasPrefix "dir-" $d))) (not (and (eq $d "") (hasPrefix "dir-" $p))) -}}
{{- $differ = append $differ (printf "TANDEM_WORKER_ENGINE__MODEL_REVISION: prefill %s, decode %s" ($p | default "none (the folder digest)") ($d | default "none (the folder digest)")) -}}
{{- end -}}
{{- if $differ -}}
{{- fail (printf "%s: prefill and decode can never pair (%s): their workers' KV fingerprints differ, so the router would run every request as a local prefill; set the same on both pools" .where (join "; " $differ)) -}}
{{- end -}}
{{- end -}}

{{/* Where the internal TLS Secret is mounted. */}}
{{- define "tandem.internalTLSDir" -}}/etc/tandem/tls{{- end -}}

{{/* TLS env of a component (when internalTLS.enabled); pass (dict "ctx" $ "prefix" "TANDEM_GATEWAY_"). */}}
{{- define "tandem.internalTLSEnv" -}}
{{- $dir := include "tandem.internalTLSDir" .ctx -}}
- name: {{ .prefix }}TLS__ENABLED
  value: "true"
- name: {{ .prefix }}TLS__CERT_FILE
  value: {{ printf "%s/tls.crt" $dir | quote }}
- name: {{ .prefix }}TLS__KEY_FILE
  value: {{ printf "%s/tls.key" $dir | quote }}
- name: {{ .prefix }}TLS__CA_FILE
  value: {{ printf "%s/ca.crt" $dir | quote }}
- name: {{ .prefix }}TLS__SERVER_NAME_OVERRIDE
  value: {{ .ctx.Values.internalTLS.serverName | quote }}
{{- end -}}

{{/* Who issues the internal certificates: certManager, helm or existing ("auto" resolved). */}}
{{- define "tandem.internalTLSIssuer" -}}
{{- $issuer := .Values.internalTLS.issuer -}}
{{- if eq $issuer "auto" -}}
{{- if .Capabilities.APIVersions.Has "cert-manager.io/v1" }}certManager{{ else }}helm{{ end -}}
{{- else -}}
{{- $issuer -}}
{{- end -}}
{{- end -}}

{{/* Prefix of the internal TLS Secrets (<prefix>-<role>, <prefix>-ca). */}}
{{- define "tandem.internalTLSPrefix" -}}
{{- .Values.internalTLS.secretPrefix | default (printf "%s-tls" (include "tandem.fullname" .)) -}}
{{- end -}}

{{/* A role's internal TLS Secret; pass (dict "ctx" $ "role" "gateway"). */}}
{{- define "tandem.internalTLSSecret" -}}
{{- printf "%s-%s" (include "tandem.internalTLSPrefix" .ctx) .role -}}
{{- end -}}

{{/* A role's internal TLS Secret as a volume (when internalTLS.enabled); pass (dict "ctx" $ "role" "gateway"). */}}
{{- define "tandem.internalTLSVolume" -}}
- name: internal-tls
  secret:
    secretName: {{ include "tandem.internalTLSSecret" . }}
    defaultMode: 0440
{{- end -}}

{{- define "tandem.internalTLSMount" -}}
- name: internal-tls
  mountPath: {{ include "tandem.internalTLSDir" . }}
  readOnly: true
{{- end -}}

{{/* The router pod's TLS front container (with internalTLS): mutual TLS for the gateway on tlsPort,
forwarded to Serve's gRPC proxy on the pod's loopback; pass (dict "ctx" $ "image" $image). */}}
{{- define "tandem.routerTLSFront" -}}
- name: tls-front
  image: {{ .image }}
  imagePullPolicy: {{ .ctx.Values.images.router.pullPolicy }}
  command: ["python", "-m", "tandem.router.tls_front"]
  env:
    - name: TANDEM_ROUTER_GRPC_PORT
      value: {{ .ctx.Values.router.grpcPort | quote }}
    - name: TANDEM_ROUTER_TLS_PORT
      value: {{ .ctx.Values.router.tlsPort | quote }}
    {{- include "tandem.internalTLSEnv" (dict "ctx" .ctx "prefix" "TANDEM_ROUTER_") | nindent 4 }}
    - name: HOME
      value: /tmp
  ports:
    - {name: grpc-tls, containerPort: {{ .ctx.Values.router.tlsPort }}, protocol: TCP}
  readinessProbe:
    tcpSocket: {port: grpc-tls}
    periodSeconds: 5
  resources:
    {{- toYaml .ctx.Values.router.tlsFrontResources | nindent 4 }}
  securityContext:
    {{- toYaml .ctx.Values.containerSecurityContext | nindent 4 }}
  volumeMounts:
    - {name: tmp, mountPath: /tmp}
    {{- include "tandem.internalTLSMount" .ctx | nindent 4 }}
{{- end -}}

{{/* The router's prefill budget per worker (uncached prompt tokens in flight), the one formula: where
tandemDeployment.autoscaling.capacity.prefillTokensPerSecondPerWorker is measured (tandem-loadtest sweep's
knee), what one worker computes within router.prefillBudgetTtftShare of tandemDeployment.slo.ttftP90Seconds
(per-worker tokens/s x TTFT target x share, at least 1); unmeasured (0), router.prefillTokensInFlight. The
router admits it (TANDEM_ROUTER_BUDGET__PREFILL_TOKENS_IN_FLIGHT) and the operator's per-replica target is
autoscaling.prefill.budgetUsage of it (tandemdeployment.yaml), so "waiting for budget" means short of
capacity. Its Python twin, for make autoscale-demo, is tandem_operator.capacity: tests/chart/test_one_set_of_numbers.py
holds the two equal. Pass the root context. */}}
{{- define "tandem.prefillBudgetTokens" -}}
{{- $perWorker := float64 (default 0 .Values.tandemDeployment.autoscaling.capacity.prefillTokensPerSecondPerWorker) }}
{{- if gt $perWorker 0.0 }}
{{- max 1 (int (floor (mulf $perWorker .Values.tandemDeployment.slo.ttftP90Seconds .Values.router.prefillBudgetTtftShare))) }}
{{- else }}
{{- int .Values.router.prefillTokensInFlight }}
{{- end }}
{{- end -}}

{{/* Shared parts of the Ray head and worker containers; pass (dict "ctx" $). */}}
{{- define "tandem.routerContainerCommon" -}}
imagePullPolicy: {{ .ctx.Values.images.router.pullPolicy }}
env:
  {{- include "tandem.redisEnv" (dict "ctx" .ctx "prefix" "TANDEM_ROUTER_" "component" "router") | nindent 2 }}
  - name: TANDEM_ROUTER_LEDGER__SECRET_FILE
    value: /etc/tandem/router-ledger/secret
  - name: TANDEM_ROUTER_POLICY
    value: {{ .ctx.Values.router.policy | quote }}
  - name: TANDEM_ROUTER_DISAGGREGATION__MIN_UNCACHED_TOKENS
    value: {{ .ctx.Values.router.minUncachedTokensToDisaggregate | quote }}
  - name: TANDEM_ROUTER_BUDGET__PREFILL_TOKENS_IN_FLIGHT
    value: {{ include "tandem.prefillBudgetTokens" .ctx | quote }}
  - name: TANDEM_ROUTER_GRPC_PORT
    value: {{ .ctx.Values.router.grpcPort | quote }}
  - name: HOME
    value: /tmp
securityContext:
  {{- toYaml .ctx.Values.containerSecurityContext | nindent 2 }}
volumeMounts:
  - {name: tmp, mountPath: /tmp}
  - {name: router-ledger, mountPath: /etc/tandem/router-ledger, readOnly: true}
{{- end -}}

{{/* The Secret holding the router replicas' ledger secret (key "secret"). */}}
{{- define "tandem.routerLedgerSecretName" -}}
{{- .Values.router.ledgerSecret.existingSecret | default (printf "%s-router-ledger" (include "tandem.fullname" .)) -}}
{{- end -}}

{{/* The router pods' volume of it; pass $. */}}
{{- define "tandem.routerLedgerVolume" -}}
- name: router-ledger
  secret:
    secretName: {{ include "tandem.routerLedgerSecretName" . }}
    defaultMode: 0440
{{- end -}}

{{/*
A histogram bucket bound as prometheus_client writes it in "le" (Go's %g with at least one
decimal: 2 -> "2.0", 0.1 -> "0.1"). An SLO of 2 written "2" matches no series.
*/}}
{{- define "tandem.promLe" -}}
{{- $v := float64 . -}}
{{- if eq $v (floor $v) -}}{{ printf "%.1f" $v }}{{- else -}}{{ $v }}{{- end -}}
{{- end -}}

{{/* The workers' KV-transfer port of rank 0 (tandem_operator.resources.KV_PORT; rank r listens on it + r). */}}
{{- define "tandem.kvPort" -}}50061{{- end -}}

{{/* The largest tensor-parallel size of any pool (the KV ports the workers open). */}}
{{- define "tandem.maxTensorParallelSize" -}}
{{- $max := 1 -}}
{{- $pools := list -}}
{{- if .Values.tandemDeployment.models -}}
{{- range .Values.tandemDeployment.models -}}
{{- $pools = append (append $pools (.prefill | default dict)) (.decode | default dict) -}}
{{- end -}}
{{- else -}}
{{- $pools = list .Values.tandemDeployment.pools.prefill .Values.tandemDeployment.pools.decode -}}
{{- end -}}
{{- range $pools -}}
{{- $tp := int ((.engineArgs | default dict).tensorParallelSize | default 1) -}}
{{- if gt $tp $max }}{{ $max = $tp }}{{ end -}}
{{- end -}}
{{- $max -}}
{{- end -}}

{{/* toYaml that fails instead of rendering nothing: helm's toYaml returns "" when YAML cannot encode a value
(a C1 control character such as U+0086 in a string), which would drop a whole list from the custom resource
(the API server then rejects it halfway through the install). */}}
{{- define "tandem.toYaml" -}}
{{- $out := toYaml . -}}
{{- if and (eq $out "") (not (empty .)) -}}
{{- fail "tandemDeployment: a value holds characters YAML cannot encode (control characters U+0080..U+009F?)" -}}
{{- end -}}
{{- $out -}}
{{- end -}}

{{/* The name clients send for the first served model (the models form's first, else model.servedModelName). */}}
{{- define "tandem.firstServedModel" -}}
{{- with .Values.tandemDeployment.models -}}{{ (first .).name }}{{- else -}}{{ .Values.model.servedModelName }}{{- end -}}
{{- end -}}

{{/* The gateway's paths routed from outside (Ingress, HTTPRoute), as a YAML list of {path, type}: the API,
its OpenAPI document, and the playground page only with gateway.publicPlayground. Never /metrics, /healthz,
/readyz. Prefix /v1 matches /v1 and /v1/... (not /v1x). */}}
{{- define "tandem.gatewayPublicPaths" -}}
- {path: /v1, type: Prefix}
- {path: /openapi.json, type: Exact}
{{- if .Values.gateway.publicPlayground }}
- {path: /, type: Exact}
{{- end }}
{{- end -}}

{{/* The SLO's percentile: tandemDeployment.slo's targets are p90s, the quantile the operator's autoscaler
reads (tandem_operator.signals, histogram_quantile(0.9, ...)). The alert rules' error budget is what it leaves,
as PromQL arithmetic (Sprig's sub is integer math): the two call the same traffic on target. */}}
{{- define "tandem.sloQuantile" -}}0.9{{- end -}}
{{- define "tandem.sloErrorBudget" -}}(1 - {{ include "tandem.sloQuantile" . }}){{- end -}}

{{/* "true" when the router's Ray head keeps its state in Redis (KubeRay's GCS fault tolerance): router.gcsFaultTolerance.enabled,
or when it is null, the chart's own Redis with the chart's own Secret (whose users the chart writes). */}}
{{- define "tandem.gcsFaultTolerance" -}}
{{- $ft := .Values.router.gcsFaultTolerance -}}
{{- if kindIs "bool" $ft.enabled -}}
{{- if $ft.enabled }}true{{ end -}}
{{- else if and .Values.redis.enabled (not .Values.redis.existingSecret) -}}
true
{{- end -}}
{{- end -}}

{{/* KubeRay's gcsFaultToleranceOptions for the router's RayCluster (KubeRay 1.3 or newer): the chart's Redis and its
raygcs user (tandem.common.redis_acl), or router.gcsFaultTolerance.redisAddress and its password Secret. */}}
{{- define "tandem.gcsFaultToleranceOptions" -}}
{{- $ft := .Values.router.gcsFaultTolerance -}}
{{- $auth := and .Values.redis.auth.enabled (not $ft.redisAddress) -}}
{{- if and (not $ft.redisAddress) (or $ft.username $ft.passwordSecret.name) -}}
{{- fail "router.gcsFaultTolerance: username and passwordSecret are for redisAddress's Redis (the chart's Redis uses its raygcs user)" -}}
{{- end -}}
{{- if $ft.redisAddress }}
redisAddress: {{ $ft.redisAddress | quote }}
{{- else if .Values.redis.enabled }}
redisAddress: {{ printf "%s-redis:6379" (include "tandem.fullname" .) | quote }}
{{- else }}
{{- fail "router.gcsFaultTolerance: with an external Redis, set redisAddress (host:port of the Redis the Ray head keeps its state in) or enabled: false" }}
{{- end }}
{{- if $auth }}
redisUsername:
  value: {{ printf "%s-raygcs" .Values.redis.keyPrefix | quote }}
redisPassword:
  valueFrom:
    secretKeyRef:
      name: {{ include "tandem.redisSecretName" . }}
      key: raygcs-password
{{- else }}
{{- with $ft.username }}
redisUsername:
  value: {{ . | quote }}
{{- end }}
{{- if $ft.passwordSecret.name }}
redisPassword:
  valueFrom:
    secretKeyRef:
      name: {{ $ft.passwordSecret.name | quote }}
      key: {{ $ft.passwordSecret.key | quote }}
{{- end }}
{{- end }}
externalStorageNamespace: {{ printf "%s-raygcs" .Values.redis.keyPrefix | quote }}
{{- end -}}
