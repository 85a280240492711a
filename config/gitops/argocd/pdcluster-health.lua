-- Argo CD health check for PDCluster (serving.pdcluster.dev). Argo CD runs it with the live
-- object as `obj`; it reads the operator's Ready condition, at the generation the operator saw.
local hs = {status = "Progressing", message = "waiting for the pdcluster-operator to report status"}
if obj.status == nil or obj.status.conditions == nil then
  return hs
end
local generation = obj.metadata.generation or 0
if (obj.status.observedGeneration or 0) < generation then
  hs.message = "waiting for the pdcluster-operator to observe generation " .. tostring(generation)
  return hs
end
-- Reasons that will not go away by waiting: someone has to act (the API's
-- ReasonsNeedingSomeone, api/v1alpha1/conditions.go).
local degraded = {
  Unschedulable = true, CrashLoopBackOff = true, ImagePullFailed = true, ContainerFailed = true,
  InvalidSpec = true, ApplyFailed = true, MultiNodeUnavailable = true,
  RestartBudgetExhausted = true, RestartFailed = true,
}
local ready = nil
for _, c in ipairs(obj.status.conditions) do
  if c.type == "Ready" then
    ready = c
  elseif c.type == "ConnectorHealthy" and c.status == "False" and degraded[c.reason] then
    hs.status = "Degraded"
    hs.message = c.reason .. ": " .. (c.message or "")
    return hs
  end
end
if ready == nil then
  return hs
end
local message = (ready.reason or "") .. ": " .. (ready.message or "")
if ready.status == "True" then
  hs.status = "Healthy"
elseif degraded[ready.reason] then
  hs.status = "Degraded"
end
hs.message = message
return hs
