FROM node:20-slim
WORKDIR /app
COPY package.json package-lock.json ./
RUN npm ci --omit=dev
COPY bin ./bin
COPY src ./src
COPY tsconfig.json ./
USER node
ENTRYPOINT ["node", "bin/lease-ops.js"]
CMD ["worker"]
