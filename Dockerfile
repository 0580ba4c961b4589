# Build stage: compile the TypeScript sources to dist/.
FROM node:24-slim AS build
WORKDIR /app
COPY package.json package-lock.json ./
RUN npm ci --ignore-scripts
COPY tsconfig.json tsconfig.build.json ./
COPY scripts ./scripts
COPY src ./src
COPY packages/client ./packages/client
RUN npm run build

# Runtime: the current LTS line, production dependencies only, as the unprivileged node user.
FROM node:24-slim
ENV NODE_ENV=production
WORKDIR /app
COPY package.json package-lock.json ./
# --omit=optional as well: typescript comes in as an optional peer of a Bull Board
# dependency (23 MB); the optional native msgpackr-extract has a JavaScript fallback.
RUN npm ci --omit=dev --omit=optional --ignore-scripts && npm cache clean --force
COPY --from=build /app/dist ./dist
COPY bin ./bin
USER node
ENTRYPOINT ["node", "bin/lease-ops.js"]
CMD ["worker"]
